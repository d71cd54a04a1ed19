"""The grammar of software strings: format placeholders (masked to sentinels for
translation) and keyboard accelerators."""
