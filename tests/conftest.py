"""Fixtures shared by the test files."""
import pytest


@pytest.fixture
def world_one(monkeypatch):
    """A default cpu group of one rank in this process (no launcher variables)."""
    import ddpc
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "DDPC_TOKEN", "DDPC_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    ddpc.init_process_group(backend="cpu", rank=0, world_size=1, timeout=30)
    yield ddpc
    ddpc.destroy_process_group()
