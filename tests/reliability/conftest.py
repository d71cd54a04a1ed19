"""The reliability suite reuses the service tests' tiny checkpoints."""

from tests.service.conftest import weights_dir  # noqa: F401  (a fixture)
