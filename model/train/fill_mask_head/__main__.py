"""``python -m model.train.fill_mask_head``: the sub-commands (``cli``)."""

from model.train.fill_mask_head.cli import main

main()
