"""The DDPC_* environment settings (csrc/settings.c): one table that every reader goes through,
values that are not settings refused with what they take (by the C core, init_process_group, the
launchers and the doctor), names ddpc does not read pointed out, and NCCL_P2P_DISABLE read the
way NCCL reads it."""
import os
import re
import subprocess
import sys
import threading

import pytest

import ddpc
from ddpc import _C, _settings, doctor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "DDPC_TOKEN", "DDPC_TIMEOUT")


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for name, _ in _C.settings():
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    ddpc.destroy_process_group()


def _names_read_in_sources():
    """Every DDPC_* name the C core and the package read from the environment, found in their
    sources: getenv("DDPC_..."), ddpc_setting_*("DDPC_..."), env_ctas("DDPC_..."),
    _C.setting("DDPC_...") / _C.setting_flag("DDPC_..."), os.environ.get("DDPC_...") /
    os.environ["DDPC_..."], and setup.py's."""
    pats = [r'getenv\("(DDPC_\w+)"\)', r'ddpc_setting_\w+\("(DDPC_\w+)"', r'env_ctas\("(DDPC_\w+)"',
            r'environ\.get\("(DDPC_\w+)"', r'environ\["(DDPC_\w+)"\]',
            r'setting(?:_flag)?\("(DDPC_\w+)"']
    files = [os.path.join(ROOT, "csrc", f) for f in os.listdir(os.path.join(ROOT, "csrc"))
             if f.endswith((".c", ".cu"))]
    pkg = os.path.join(ROOT, "python", "ddpc")
    files += [os.path.join(pkg, f) for f in os.listdir(pkg) if f.endswith(".py")]
    files.append(os.path.join(ROOT, "setup.py"))
    found = set()
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for p in pats:
            found.update(re.findall(p, text))
    return found


def test_the_table_lists_every_setting_read_and_the_readme_documents_them():
    table = dict(_C.settings())
    read = _names_read_in_sources()
    assert "DDPC_FAST_ALLREDUCE" in read and "DDPC_TIMEOUT" in read, read  # the scan works
    assert read - set(table) == set(), "read but not in csrc/settings.c's table"
    assert set(table) - read == set(), "in the table but read nowhere"
    assert all(about for about in table.values())
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert [n for n in table if f"`{n}" not in readme] == [], "settings README.md leaves out"


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("YES", True), ("On", True),
                                       ("0", False), ("false", False), ("No", False),
                                       ("OFF", False)])
def test_flags_take_1_0_and_their_words(clean_env, value, on):
    clean_env.setenv("DDPC_GRAD_BATCH", value)
    assert _C.setting_flag("DDPC_GRAD_BATCH", not on) is on
    _C.check_settings()


def test_unset_or_empty_flags_take_the_default(clean_env):
    assert _C.setting_flag("DDPC_GRAD_BATCH", True) is True
    clean_env.setenv("DDPC_GRAD_BATCH", "")
    assert _C.setting_flag("DDPC_GRAD_BATCH", False) is False


@pytest.mark.parametrize("name, value, takes", [
    ("DDPC_FAST_ALLREDUCE", "maybe", "use 1 or 0"),
    ("DDPC_STAGED_OVERLAP", "2", "use 1 or 0"),
    ("DDPC_COMM_CASTS", " 1", "use 1 or 0"),
    ("DDPC_SAMPLER_THREADS", "0", "use a whole number from 1 to 64"),
    ("DDPC_SAMPLER_THREADS", "-3", "use a whole number from 1 to 64"),
    ("DDPC_SAMPLER_THREADS", "3.5", "use a whole number from 1 to 64"),
    ("DDPC_SAMPLER_THREADS", "65", "use a whole number from 1 to 64"),
    ("DDPC_SHM_SLOT_BYTES", "4096", "use a whole number from 65536 to 67108864"),
    ("DDPC_STAGED_CHUNK_BYTES", "1MiB", "use a whole number from 65536 to 67108864"),
    ("DDPC_STAGED_MIN_BYTES", "-1", "use a whole number from 0 to"),
    ("DDPC_NCCL_MAX_CTAS", "99999999999999999999", "use a whole number from 1 to 64"),
    ("DDPC_TAIL_BUCKET_MB", "nan", "use a number from 0 to 1e+09"),
    ("DDPC_TAIL_BUCKET_MB", "-1", "use a number from 0 to 1e+09"),
    ("DDPC_TAIL_BUCKET_MB", "inf", "use a number from 0 to 1e+09"),
    ("DDPC_CAST_BACK", "soon", "use end or early or overlap"),
    ("DDPC_DEBUG", "verbose", "use INFO, TRACE or OFF"),
])
def test_a_value_that_is_not_a_setting_is_refused_with_what_it_takes(clean_env, name, value,
                                                                      takes):
    with pytest.raises(ValueError) as e:
        _C.check_setting(name, value)
    msg = str(e.value)
    assert msg.startswith(f"{name}={value} is not a setting: {takes}"), msg
    assert "or unset it" in msg, msg
    # the same message from the environment, for every setting at once
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(msg)):
        _C.check_settings()


@pytest.mark.parametrize("name, value", [
    ("DDPC_SAMPLER_THREADS", "64"), ("DDPC_SHM_SLOT_BYTES", "65536"),
    ("DDPC_STAGED_MIN_BYTES", "0"), ("DDPC_TAIL_BUCKET_MB", "0.5"), ("DDPC_TAIL_BUCKET_MB", "1e3"),
    ("DDPC_CAST_BACK", "EARLY"), ("DDPC_DEBUG", "info"), ("DDPC_DEBUG", "2"),
    ("DDPC_NCCL_MIN_CTAS", "1"), ("DDPC_TIMEOUT", "0.5"), ("DDPC_EMBEDDING_ROWS", "AUTO"),
    ("DDPC_TOKEN", "any text: checked by the store"),
])
def test_values_that_are_settings_pass(name, value):
    _C.check_setting(name, value)


@pytest.mark.parametrize("name, value, read", [
    ("DDPC_GRAD_BATCH", "off", False), ("DDPC_SAMPLER_THREADS", "12", 12),
    ("DDPC_TIMEOUT", "2.5", 2.5), ("DDPC_CPU_TRANSPORT", "SHM", "shm"),
    ("DDPC_DEBUG", "trace", 2), ("DDPC_TOKEN", "abc", "abc"), ("DDPC_TAIL_BUCKET_MB", "", None),
])
def test_the_package_reads_the_checked_value(clean_env, name, value, read):
    """ddpc._C.setting: what the Python side reads, as the C core checked it (None: unset)."""
    clean_env.setenv(name, value)
    got = _C.setting(name)
    assert got == read and type(got) is type(read), got


def test_a_name_ddpc_does_not_read_is_no_setting():
    with pytest.raises(ValueError, match="DDPC_NOPE is not a ddpc setting"):
        _C.check_setting("DDPC_NOPE", "1")
    with pytest.raises(ValueError, match="DDPC_NOPE is not a ddpc setting"):
        _C.setting_flag("DDPC_NOPE", True)
    # a setting read as another kind is the caller's mistake, named as such
    with pytest.raises(ValueError, match="DDPC_SAMPLER_THREADS is not read as this kind"):
        _C.setting_flag("DDPC_SAMPLER_THREADS", True)


def test_init_process_group_refuses_a_bad_setting_before_it_starts(clean_env):
    clean_env.setenv("DDPC_FAST_ALLREDUCE", "maybe")
    with pytest.raises(ValueError, match="DDPC_FAST_ALLREDUCE=maybe is not a setting"):
        ddpc.init_process_group(backend="cpu", rank=0, world_size=1)
    assert not ddpc.is_initialized()
    # a tuning knob that used to be ignored when out of range is refused too
    clean_env.delenv("DDPC_FAST_ALLREDUCE")
    clean_env.setenv("DDPC_SHM_SLOT_BYTES", "12")
    with pytest.raises(ValueError, match="DDPC_SHM_SLOT_BYTES=12 is not a setting"):
        ddpc.init_process_group(backend="cpu", rank=0, world_size=1)
    assert not ddpc.is_initialized()
    clean_env.setenv("DDPC_SHM_SLOT_BYTES", "65536")
    ddpc.init_process_group(backend="cpu", rank=0, world_size=1)
    assert ddpc.is_initialized()


def test_the_c_core_refuses_a_bad_setting_when_a_group_is_made(clean_env):
    """Groups made without init_process_group (ddpc._C directly) are checked as well: by
    ddpc_group_create, on every rank, before the backend starts."""
    clean_env.setenv("DDPC_STAGED_OVERLAP", "sometimes")
    server = _C.StoreServer("127.0.0.1", 0, "tok")
    got = []

    def make(rank):
        try:
            store = _C.Store("127.0.0.1", server.port, "tok", rank, 10.0)
            got.append(_C.Group(store, rank, 2, timeout=10.0, prefix=f"s{rank}"))
        except Exception as e:  # noqa: BLE001 - inspected below
            got.append(e)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 2 and all(isinstance(e, ValueError) for e in got), got
    assert all("DDPC_STAGED_OVERLAP=sometimes is not a setting" in str(e) for e in got), got
    server.stop()


def test_the_sampler_refuses_a_bad_thread_count(clean_env):
    clean_env.setenv("DDPC_SAMPLER_THREADS", "0")
    s = ddpc.DistributedSampler(list(range(100)), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="DDPC_SAMPLER_THREADS=0 is not a setting"):
        list(iter(s))


@pytest.mark.parametrize("disable, level, off", [
    ("1", None, "NCCL_P2P_DISABLE=1"), ("0x1", None, "NCCL_P2P_DISABLE=0x1"),
    ("01", "NVL", "NCCL_P2P_DISABLE=01"), (None, None, None), ("", None, None), ("0", None, None),
    ("2", None, None), ("true", None, None), ("yes", None, None),
    (None, "LOC", "NCCL_P2P_LEVEL=LOC"), ("0", "0", "NCCL_P2P_LEVEL=0"), (None, "NVL", None),
    (None, "SYS", None), (None, "3", None), (None, "loc", None),
])
def test_nccl_p2p_settings_are_read_as_nccl_reads_them(disable, level, off):
    """NCCL turns P2P off when NCCL_P2P_DISABLE reads as the number 1 (strtol, base 0; so
    NCCL_P2P_DISABLE=true leaves it on), or else when NCCL_P2P_LEVEL is LOC or an old-style 0.
    ddpc's staged and one-shot paths follow that reading."""
    assert _C.nccl_p2p_off(disable, level) == off


def test_the_doctor_names_bad_values_unknown_names_and_a_p2p_setting_that_does_nothing():
    got = doctor.env_verdicts({"DDPC_STAGED_OVERLAP": "maybe", "DDPC_FAST_ALLREDUSE": "0",
                               "NCCL_P2P_DISABLE": "true", "DDPC_TIMEOUT": "30"})
    kinds = [k for k, _ in got]
    assert kinds == ["PROBLEM", "WARNING", "WARNING", "NOTE"], got
    assert got[0][1].startswith("DDPC_STAGED_OVERLAP=maybe is not a setting: use 1 or 0")
    assert got[1][1].startswith("DDPC_FAST_ALLREDUSE is not a ddpc setting, so it changes "
                                "nothing (did you mean DDPC_FAST_ALLREDUCE?)"), got[1]
    assert got[2][1].startswith("NCCL_P2P_DISABLE=true leaves P2P on"), got[2]
    # only the settings not judged above are listed
    assert got[3][1].endswith(": DDPC_TIMEOUT=30"), got[3]
    assert _settings.unknown_names({"DDPC_ZZZ": "1"}) == [
        ("DDPC_ZZZ", "DDPC_ZZZ is not a ddpc setting, so it changes nothing; README.md lists "
                     "ddpc's settings")]
    # P2P turned off by its level instead: named as such, and not listed again
    got = doctor.env_verdicts({"NCCL_P2P_LEVEL": "LOC"})
    assert [k for k, _ in got] == ["WARNING"], got
    assert got[0][1].startswith("NCCL_P2P_LEVEL=LOC: the GPUs exchange data through host "
                                "memory"), got


def test_a_misspelt_cuda_visible_devices_is_named():
    """CUDA reads only CUDA_VISIBLE_DEVICES: a near miss hides no GPU (the mission's 'OOM on GPU
    0' when the user meant GPUs 2 and 3), so the doctor and the launchers say so."""
    env = {"CUDA_VISIBLE_DEVICE": "2,3", "cuda_visible_devices": "1", "CUDA_VISABLE_DEVICES": "0",
           "CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": "all", "CUDA_HOME": "/cuda",
           "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    got = _settings.misspelt_visible_devices(env)
    assert [n for n, _ in got] == ["CUDA_VISABLE_DEVICES", "CUDA_VISIBLE_DEVICE",
                                   "cuda_visible_devices"], got
    assert got[1][1] == ("CUDA_VISIBLE_DEVICE=2,3 is not CUDA's setting (CUDA_VISIBLE_DEVICES), "
                         "so it hides no GPU: rename it to CUDA_VISIBLE_DEVICES, or pick the GPUs "
                         "with `python -m ddpc.launch --gpus 2,3`")
    verdicts = doctor.env_verdicts({"CUDA_VISIBLE_DEVICE": "2,3"})
    assert verdicts == [("WARNING", got[1][1])], verdicts


def test_the_notebook_launcher_refuses_a_bad_setting_before_any_rank_starts(clean_env):
    clean_env.setenv("DDPC_GRAD_BATCH", "later")
    with pytest.raises(ValueError, match="DDPC_GRAD_BATCH=later is not a setting"):
        ddpc.notebook_launcher(print, nprocs=2)


def test_debug_logging_reads_the_levels_it_documents(clean_env):
    """DDPC_DEBUG=trace (any case) logs; an unknown level is refused rather than silent."""
    code = ("import ddpc; ddpc.init_process_group(backend='cpu', rank=0, world_size=1, "
            "init_method='tcp://127.0.0.1:0'); ddpc.destroy_process_group()")
    env = dict(os.environ, DDPC_DEBUG="trace")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "GROUP" in r.stderr, r.stderr
    env["DDPC_DEBUG"] = "loud"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "DDPC_DEBUG=loud is not a setting" in r.stderr, r.stderr
