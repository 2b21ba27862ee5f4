from tests.gpu_manager.conftest import manager, manager_factory  # noqa: F401 - shared fixtures
