"""``python -m service`` / ``transformer-serve``: serve the checkpoints in TSERVE_WEIGHTS_DIR."""

from __future__ import annotations

import os

# Before torch loads: OpenMP threads that spin while waiting collapse when the host is busy
# (measured here: a 2-thread decode step 2-3x slower than 1 thread next to other work).
# Passive waiting costs little on an idle host. An explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import uvicorn  # noqa: E402

from service.app import create_app  # noqa: E402
from service.settings import Settings  # noqa: E402


def main() -> None:
    settings = Settings()
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)))


if __name__ == "__main__":
    main()
