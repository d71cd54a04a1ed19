"""``python -m service`` / ``transformer-serve``: serve the checkpoints in TSERVE_WEIGHTS_DIR."""

from __future__ import annotations

import uvicorn

from service.app import create_app
from service.settings import Settings


def main() -> None:
    settings = Settings()
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)))


if __name__ == "__main__":
    main()
