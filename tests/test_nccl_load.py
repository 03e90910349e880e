"""CPU-runnable checks of the GPU path: the extension imports and reports no devices without a
driver; NCCL loading (through fake libnccl.so.2 builds: complete, too old, incomplete) follows
DDPC_NCCL_PATH / DDPC_NCCL_SEARCH_PATH and explains failures; an nccl group on a machine without
GPUs fails with a message that says why; `python -m ddpc.doctor` and its parsers; and a lint that
every CUDA and NCCL call in the GPU sources is checked."""
import ctypes
import os
import re
import shutil
import subprocess
import sys

import pytest

import ddpc
from ddpc import _C
from ddpc import doctor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYDIR = os.path.join(ROOT, "python")

# Just enough of NCCL's ABI for ddpc's loader: the symbols it looks up and a version.
FAKE_NCCL = r"""
int ncclGetVersion(int *v) { *v = FAKE_VERSION; return 0; }
int ncclGetUniqueId(void *id) { (void)id; return 0; }
const char *ncclGetErrorString(int r) { (void)r; return "fake error"; }
const char *ncclGetLastError(void *c) { (void)c; return ""; }
#ifndef FAKE_PARTIAL
int ncclCommInitRankConfig(void) { return 3; }
int ncclCommGetAsyncError(void) { return 3; }
int ncclCommFinalize(void) { return 3; }
int ncclCommDestroy(void) { return 3; }
int ncclCommAbort(void) { return 0; }
int ncclAllReduce(void) { return 3; }
int ncclBroadcast(void) { return 3; }
int ncclAllGather(void) { return 3; }
int ncclReduceScatter(void) { return 3; }
#endif
"""


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def fake_nccl(tmp_path_factory):
    """{variant: folder holding that variant's libnccl.so.2}."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    base = tmp_path_factory.mktemp("fake_nccl")
    src = base / "fake_nccl.c"
    src.write_text(FAKE_NCCL)
    out = {}
    for name, flags in {"ok": ["-DFAKE_VERSION=22803"], "old": ["-DFAKE_VERSION=21203"],
                        "partial": ["-DFAKE_VERSION=22803", "-DFAKE_PARTIAL"]}.items():
        d = base / name
        d.mkdir()
        r = subprocess.run([cc, "-shared", "-fPIC", "-Wall", *flags, str(src), "-o",
                            str(d / "libnccl.so.2")], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out[name] = str(d)
    (base / "empty").mkdir()
    out["empty"] = str(base / "empty")
    return out


def _nccl_version_in_fresh_process(env_extra: dict) -> subprocess.CompletedProcess:
    """ddpc._C.nccl_version() in a new interpreter (the loaded library is cached per process)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DDPC_NCCL_PATH", "DDPC_NCCL_SEARCH_PATH")}
    env["PYTHONPATH"] = PYDIR + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra)
    code = ("import ddpc._C as C\n"
            "try:\n    print('VERSION', C.nccl_version())\n"
            "except C.DistributedError as e:\n    print('ERROR', e)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=60)


# ------------------------------------------------------------------------- import, devices


def test_import_works_without_gpu():
    assert isinstance(_C.cuda_device_count(), int)
    assert _C.cuda_device_count() >= 0
    assert isinstance(bool(_C.cuda_built()), bool)
    if not _driver_present():
        assert _C.cuda_device_count() == 0
    assert issubclass(ddpc.DistributedTimeoutError, ddpc.DistributedError)


@pytest.mark.skipif(_C.cuda_device_count() > 0, reason="a GPU is visible here")
def test_set_device_without_gpu_explains_why():
    with pytest.raises(ddpc.DistributedError) as e:
        _C.cuda_set_device(0)
    msg = str(e.value)
    if _C.cuda_built():
        assert "no CUDA device is visible" in msg and "CUDA_VISIBLE_DEVICES" in msg, msg
    else:
        assert "no CUDA support" in msg and "DDPC_NO_CUDA" in msg, msg


# ------------------------------------------------------------------------- loading NCCL


def test_missing_nccl_lists_where_it_looked(fake_nccl):
    r = _nccl_version_in_fresh_process({"DDPC_NCCL_SEARCH_PATH": fake_nccl["empty"],
                                        "CUDA_HOME": fake_nccl["empty"]})
    if r.stdout.startswith("VERSION"):
        pytest.skip("a real NCCL is installed where the system loader finds it")
    msg = r.stdout
    assert msg.startswith("ERROR NCCL (libnccl.so.2) was not found"), msg + r.stderr
    for part in ("DDPC_NCCL_PATH (unset)", f"{fake_nccl['empty']} (no libnccl.so.2 there)",
                 f"{fake_nccl['empty']}/lib64 (no libnccl.so.2 there)", "the system loader",
                 "pip install nvidia-nccl-cu13", "cpu backend needs no NCCL"):
        assert part in msg, f"{part!r} missing from: {msg}"


def test_nccl_path_may_name_the_file_or_its_folder(fake_nccl):
    for value in (os.path.join(fake_nccl["ok"], "libnccl.so.2"), fake_nccl["ok"]):
        r = _nccl_version_in_fresh_process({"DDPC_NCCL_PATH": value})
        assert r.stdout.strip() == "VERSION 2.28.3", r.stdout + r.stderr


def test_search_path_is_searched_in_order(fake_nccl):
    r = _nccl_version_in_fresh_process(
        {"DDPC_NCCL_SEARCH_PATH": f"{fake_nccl['empty']}:{fake_nccl['ok']}:{fake_nccl['old']}"})
    assert r.stdout.strip() == "VERSION 2.28.3", r.stdout + r.stderr


def test_bad_nccl_path_is_an_error_not_a_fallback(fake_nccl):
    bad = os.path.join(fake_nccl["empty"], "nope", "libnccl.so.2")
    r = _nccl_version_in_fresh_process({"DDPC_NCCL_PATH": bad,
                                        "DDPC_NCCL_SEARCH_PATH": fake_nccl["ok"]})
    assert r.stdout.startswith(f"ERROR DDPC_NCCL_PATH={bad}: cannot load"), r.stdout + r.stderr
    assert "unset it" in r.stdout


def test_old_nccl_is_refused_with_its_version(fake_nccl):
    r = _nccl_version_in_fresh_process({"DDPC_NCCL_PATH": fake_nccl["old"]})
    assert "is version 2.12.3; ddpc needs 2.14 or newer" in r.stdout, r.stdout + r.stderr


def test_incomplete_nccl_names_the_missing_symbols(fake_nccl):
    r = _nccl_version_in_fresh_process({"DDPC_NCCL_PATH": fake_nccl["partial"]})
    assert "lacks ncclCommInitRankConfig, ncclCommGetAsyncError" in r.stdout, r.stdout + r.stderr
    assert os.path.join(fake_nccl["partial"], "libnccl.so.2") in r.stdout


@pytest.mark.skipif(_C.cuda_device_count() > 0, reason="a GPU is visible here")
def test_nccl_group_without_gpu_says_why(fake_nccl):
    code = r"""
import ddpc._C as C
srv = C.StoreServer("127.0.0.1", 0, "tok")
st = C.Store("127.0.0.1", srv.port, "tok", 0, 10.0)
try:
    C.Group(st, 0, 1, backend="nccl", timeout=10.0, prefix="t", device=0)
    print("CREATED")
except C.DistributedError as e:
    print("ERROR", e)
    print("ABORT", st.check(["t/abort"]))
"""
    env = dict(os.environ, DDPC_NCCL_PATH=fake_nccl["ok"],
               PYTHONPATH=PYDIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    if "not implemented" in r.stdout + r.stderr:
        pytest.skip("the store is not built yet")
    assert r.stdout.startswith("ERROR creating the nccl process group (rank 0 of 1): "), \
        r.stdout + r.stderr
    if _C.cuda_built():
        assert "no CUDA device is visible" in r.stdout, r.stdout
        # The failure was published, so peers waiting in the rendezvous fail at once too.
        assert "ABORT True" in r.stdout, r.stdout
    else:
        assert "no CUDA support" in r.stdout, r.stdout


# ------------------------------------------------------------------------- doctor


def test_doctor_runs_and_explains_this_machine():
    env = dict(os.environ, PYTHONPATH=PYDIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "ddpc.doctor", "--no-bench"], capture_output=True,
                       text=True, env=env, timeout=120)
    out = r.stdout
    assert out.startswith("ddpc doctor"), out + r.stderr
    assert "== Summary" in out
    if _C.cuda_device_count() == 0:
        assert r.returncode == 0, out + r.stderr
        assert "ddpc will use the cpu backend: no GPU is visible" in out, out
        if not _driver_present() and not shutil.which("nvidia-smi"):
            assert "NOTE: no GPU and no NVIDIA driver on this machine" in out, out


def _gpu(i: int, uuid: str, name: str = "NVIDIA H200") -> doctor.Gpu:
    return doctor.Gpu(i, name, uuid, f"0000:{0x1b + i:02x}:00.0", 141 * doctor.GIB,
                      140 * doctor.GIB)


GPUS = [_gpu(0, "GPU-aaaa1111"), _gpu(1, "GPU-bbbb2222"), _gpu(2, "GPU-cccc3333")]


def test_visible_mapping_follows_cuda_rules():
    assert doctor.visible_mapping(None, GPUS) == (GPUS, "")
    assert doctor.visible_mapping("2,0", GPUS) == ([GPUS[2], GPUS[0]], "")
    assert doctor.visible_mapping("GPU-bbbb", GPUS) == ([GPUS[1]], "")
    assert doctor.visible_mapping("", GPUS) == ([], "")
    got, note = doctor.visible_mapping("1,7,0", GPUS)
    assert got == [GPUS[1]] and "entry 1 ('7') names no GPU" in note
    got, note = doctor.visible_mapping("0,0", GPUS)
    assert got == [GPUS[0]] and "repeats a GPU" in note
    got, note = doctor.visible_mapping("GPU-", GPUS)  # ambiguous prefix
    assert got == [] and "names no GPU" in note


def test_busy_verdict_names_gpus_memory_and_processes():
    procs = [doctor.GpuProcess("GPU-aaaa1111", 100, int(2.6 * doctor.GIB)),
             doctor.GpuProcess("GPU-bbbb2222", 200, 2 * doctor.GIB),
             doctor.GpuProcess("GPU-bbbb2222", 300, 5 * doctor.GIB)]
    kind, text, by_gpu = doctor.busy_verdict(GPUS[:2], procs, own_pids=[300])
    assert kind == "WARNING"
    assert text.startswith("GPU 0 and 1 are busy: 4.6 GiB held by 2 other processes"), text
    assert sorted(by_gpu) == [0, 1]
    kind, text, _ = doctor.busy_verdict(GPUS, procs[2:], own_pids=[300])
    assert (kind, text) == ("OK", "no other process holds memory on GPU 0, 1, 2")


def test_parse_topo_reads_links_between_gpus():
    text = ("\x1b[4m\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
            "GPU0\t X \tNV18\tSYS\tPXB\t0-31\t0\t\tN/A\n"
            "GPU1\tNV18\t X \tSYS\tSYS\t0-31\t0\t\tN/A\n"
            "GPU2\tSYS\tSYS\t X \tSYS\t32-63\t1\t\tN/A\n"
            "NIC0\tPXB\tSYS\tSYS\t X \n\nLegend:\n  X    = Self\n  NV#  = bonded NVLinks\n")
    links = doctor.parse_topo(text)
    assert links[(0, 1)] == "NV18" and links[(1, 0)] == "NV18"
    assert links[(0, 2)] == "SYS" and (0, 0) not in links
    assert doctor.describe_link("NV18") == ("OK", "NVLink (18 links)")
    assert doctor.describe_link("SYS")[0] == "NOTE"


def test_env_verdicts_name_the_settings_that_slow_training():
    assert doctor.env_verdicts({}) == [
        ("OK", "no NCCL_*, DDPC_* or CUDA_LAUNCH_BLOCKING settings: NCCL and ddpc choose for "
               "themselves")]
    # ddpc's own default (set when it is imported) is not the user's doing
    assert doctor.env_verdicts({"NCCL_RUNTIME_CONNECT": "0", "PATH": "/bin",
                                "NCCL_VERSION": "2.28.3-1"})[0][0] == "OK"
    got = doctor.env_verdicts({
        "NCCL_PROTO": "LL128", "NCCL_ALGO": "Tree", "NCCL_P2P_READ_ENABLE": "0",
        "NCCL_P2P_DISABLE": "1", "CUDA_LAUNCH_BLOCKING": "1", "NCCL_DEBUG": "INFO",
        "DDPC_CAST_BACK": "early", "NCCL_NVLS_ENABLE": "0", "NCCL_RUNTIME_CONNECT": "0"})
    kinds = [k for k, _ in got]
    assert kinds == ["WARNING"] * 5 + ["NOTE", "NOTE"], got
    text = [t for _, t in got]
    assert text[0].startswith("NCCL_PROTO=LL128 limits the protocols NCCL may pick") and \
        "0.85 with LL128" in text[0] and "Unset it" in text[0], text[0]
    assert text[1].startswith("NCCL_ALGO=Tree limits the algorithms") and "fails" in text[1]
    assert text[2].startswith("NCCL_P2P_READ_ENABLE=0") and "0.88-0.89" in text[2]
    assert text[3].startswith("NCCL_P2P_DISABLE=1: the GPUs exchange data through host memory")
    assert text[4].startswith("CUDA_LAUNCH_BLOCKING=1: every kernel launch waits")
    assert text[5].startswith("NCCL_DEBUG=INFO")
    # the rest, sorted, without those already judged or ddpc's own default
    assert text[6].endswith(": DDPC_CAST_BACK=early, NCCL_NVLS_ENABLE=0"), text[6]
    # settings that turn nothing off are listed, not warned about
    got = doctor.env_verdicts({"NCCL_P2P_DISABLE": "0", "CUDA_LAUNCH_BLOCKING": "0",
                               "NCCL_P2P_READ_ENABLE": "1", "NCCL_DEBUG": "WARN"})
    assert [k for k, _ in got] == ["NOTE"], got
    assert got[0][1].endswith(": NCCL_DEBUG=WARN, NCCL_P2P_DISABLE=0, NCCL_P2P_READ_ENABLE=1")


def test_doctor_warns_about_a_protocol_forced_in_the_environment():
    env = dict(os.environ, PYTHONPATH=PYDIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NCCL_PROTO="LL128")
    r = subprocess.run([sys.executable, "-m", "ddpc.doctor", "--no-bench", "--host-seconds", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    env_section = r.stdout.split("== Environment", 1)[1].split("\n== ", 1)[0]
    assert "WARNING: NCCL_PROTO=LL128 limits the protocols NCCL may pick" in env_section, r.stdout
    warnings = int(re.search(r"(\d+) warning\(s\)", r.stdout).group(1))
    assert warnings >= 1, r.stdout


def test_bus_ids_compare_across_sources():
    assert doctor.normalize_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert doctor.normalize_bus_id("0000:1b:00.0") == "0000:1b:00.0"
    assert doctor.normalize_bus_id("1b:00.0") == "0000:1b:00.0"


PROC_STAT = """cpu  100 5 20 1000 10 1 2 30 0 0
cpu0 50 5 10 500 5 1 1 15 0 0
cpu1 50 0 10 500 5 0 1 15 0 0
intr 12345 0 0
ctxt 999
"""


def test_parse_proc_stat_reads_busy_idle_and_steal():
    got = doctor.parse_proc_stat(PROC_STAT)
    assert set(got) == {"cpu", "cpu0", "cpu1"}
    assert got["cpu"] == doctor.CpuTimes(busy=100 + 5 + 20 + 1 + 2, idle=1000 + 10, steal=30)
    assert got["cpu1"] == doctor.CpuTimes(busy=61, idle=505, steal=15)
    # a kernel older than the steal field: it counts as none
    assert doctor.parse_proc_stat("cpu 1 2 3 4\n")["cpu"] == doctor.CpuTimes(6, 4, 0)
    now = doctor.read_cpu_times()  # this machine's
    if os.path.exists("/proc/stat"):
        assert now.busy > 0 and now.idle >= 0 and now.steal >= 0
    else:
        assert now is None


def test_host_load_separates_own_work_other_work_and_steal():
    a = doctor.CpuTimes(busy=1000, idle=5000, steal=100)
    # 400 ticks on 4 CPUs: 250 busy (100 of them ours), 100 idle, 50 stolen
    b = doctor.CpuTimes(busy=1250, idle=5100, steal=150)
    others, steal = doctor.host_load(a, b, own_ticks=100, ncpus=4)
    assert others == pytest.approx(150 / 400 * 4)
    assert steal == pytest.approx(50 / 400)
    assert doctor.host_load(a, a, 0, 4) == (0.0, 0.0)  # no time passed: nothing to say
    assert doctor.host_load(a, b, own_ticks=1000, ncpus=4)[0] == 0.0  # never below 0


def test_host_verdicts_say_what_takes_the_cpus():
    steady = [2.0, 2.1, 2.0, 2.05, 2.0, 2.1]
    assert doctor.host_verdicts(0.0, 0.0, 8, steady) == [
        ("OK", "the host's CPUs were steady, and free of other work")]
    kinds = lambda *a: [k for k, _ in doctor.host_verdicts(*a)]  # noqa: E731
    assert kinds(0.0, 0.12, 8, steady) == ["WARNING"]
    assert "12% of these CPUs' time (steal)" in doctor.host_verdicts(0.0, 0.12, 8, steady)[0][1]
    assert kinds(0.0, 0.02, 8, steady) == ["NOTE"]
    assert kinds(5.0, 0.0, 8, steady) == ["WARNING"]
    assert "5.0 of the 8 CPUs busy" in doctor.host_verdicts(5.0, 0.0, 8, steady)[0][1]
    assert kinds(1.5, 0.0, 8, steady) == ["NOTE"]
    assert kinds(0.4, 0.0, 1, steady) == ["OK"]
    # speed that varies: judged between the 10th and 90th percentiles, not by one outlier
    varying = [2.0] * 5 + [4.0] * 5
    assert kinds(0.0, 0.0, 8, varying) == ["NOTE"]
    assert kinds(0.0, 0.0, 8, [2.0] * 19 + [9.0]) == ["OK"]


def test_doctor_samples_the_host_and_checks_its_setting():
    env = dict(os.environ, PYTHONPATH=PYDIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = lambda *a: subprocess.run([sys.executable, "-m", "ddpc.doctor", "--no-bench", *a],  # noqa: E731
                                    capture_output=True, text=True, env=env, timeout=120)
    r = run("--host-seconds", "0.3")
    assert "== Host CPUs" in r.stdout, r.stdout + r.stderr
    assert re.search(r"a fixed piece of Python, \d+ times in 0\.\d s: [\d.]+ ms fastest", r.stdout)
    if os.path.exists("/proc/stat"):
        assert re.search(r"other work kept \d+\.\d of \d+ CPUs busy, and the hypervisor took "
                         r"[\d.]+% of their time \(steal\)", r.stdout), r.stdout
    r = run("--host-seconds", "0")
    assert "NOTE: skipped the host sample (--host-seconds 0)" in r.stdout, r.stdout
    r = run("--host-seconds", "-1")
    assert r.returncode == 2 and "--host-seconds must be between 0 and 600, got -1" in r.stderr


def test_nccl_search_path_finds_wheels_on_sys_path(tmp_path, monkeypatch):
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing"), str(tmp_path)])
    assert doctor.nccl_search_path() == str(lib)
    monkeypatch.delenv("DDPC_NCCL_SEARCH_PATH", raising=False)
    doctor.export_nccl_search_path()
    assert os.environ["DDPC_NCCL_SEARCH_PATH"] == str(lib)


# ------------------------------------------------------------------------- lint


GPU_SOURCES = ["csrc/comm_nccl.c", "csrc/cuda.c", "csrc/kernels.cu"]


def _code_lines(path: str):
    """(line number, text) of code, with comments and string literals blanked out."""
    text = open(os.path.join(ROOT, path)).read()
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"//[^\n]*", "", text)
    return list(enumerate(text.splitlines(), 1))


def test_every_cuda_and_nccl_call_is_checked():
    """A CUDA runtime call (cudaX) or NCCL call (g_api.X) must sit in a check macro, be assigned
    or returned, or be one of the calls that cannot fail."""
    never_fail = ("cudaGetErrorName", "cudaGetErrorString", "cudaGetLastError")
    wrapped = re.compile(r"(DDPC_CUDACHECK(_GOTO)?|CUDA_LOG|NCCLCHECK(_GOTO)?|CUDA_OK)\s*\(")
    unchecked = []
    for path in GPU_SOURCES:
        lines = _code_lines(path)
        for i, (no, line) in enumerate(lines):
            for m in re.finditer(r"\b(cuda[A-Z]\w*|g_api\.\w+)\s*\(", line):
                call = m.group(1)
                if call.startswith(never_fail) or call in ("g_api.GetErrorString",
                                                           "g_api.GetLastError"):
                    continue
                before = line[:m.start()]
                prev = lines[i - 1][1] if i else ""
                ok = (wrapped.search(before) or re.search(r"(=|return|\()\s*$", before)
                      or re.search(r"(=|return)\s*$", prev.rstrip())
                      or wrapped.search(prev) and not prev.rstrip().endswith(";"))
                if not ok:
                    unchecked.append(f"{path}:{no}: {line.strip()}")
    assert not unchecked, "unchecked CUDA/NCCL calls:\n" + "\n".join(unchecked)
