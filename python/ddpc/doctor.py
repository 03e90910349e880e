"""``python -m ddpc.doctor``: what this machine offers ddpc, and what is in the way.

Prints the GPUs (index, name, PCI bus id, memory), the memory other processes hold on each, how
CUDA_VISIBLE_DEVICES maps visible ordinals to physical GPUs, the driver, CUDA and NCCL versions,
peer-to-peer access between GPU pairs, a measured all-reduce bandwidth through ddpc's nccl
backend, and how steady the host's CPUs are (what other work and the hypervisor take from them,
and how long a fixed piece of Python takes from one moment to the next), and the NCCL, CUDA and
ddpc settings in the environment that change how they work. Each finding ends in a
one-line verdict: ``OK:``, ``NOTE:``, ``WARNING:`` or ``PROBLEM:``.
Works without torch (NVML through ctypes, or nvidia-smi); the bandwidth test needs torch for
device memory. Exit status 1 when a PROBLEM was found, else 0.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ddpc import _C, _settings

GIB = 1024 ** 3
MIB = 1024 ** 2


@dataclass
class Gpu:
    """One physical GPU as the driver (NVML / nvidia-smi) numbers them."""

    index: int
    name: str
    uuid: str
    bus_id: str          # normalized "0000:1b:00.0"
    mem_total: int       # bytes
    mem_free: int        # bytes


@dataclass
class GpuProcess:
    """A process holding memory on a GPU."""

    gpu_uuid: str
    pid: int
    used: int            # bytes; 0 when the driver does not say
    name: str = ""


@dataclass
class DriverInfo:
    source: str = ""                         # "NVML" or "nvidia-smi"
    driver: str = ""
    cuda: str = ""                           # the highest CUDA version the driver supports
    gpus: List[Gpu] = field(default_factory=list)
    processes: Optional[List[GpuProcess]] = None   # None: could not be listed
    error: str = ""


class Report:
    """Collects the printed lines and the verdicts."""

    def __init__(self) -> None:
        self.problems = 0
        self.warnings = 0

    def section(self, title: str) -> None:
        print(f"\n== {title}")

    def line(self, text: str) -> None:
        print(f"   {text}")

    def verdict(self, kind: str, text: str) -> None:
        if kind == "PROBLEM":
            self.problems += 1
        elif kind == "WARNING":
            self.warnings += 1
        print(f"   {kind}: {text}")


# ------------------------------------------------------------------------- helpers


def fmt_bytes(n: float) -> str:
    """1.5 GiB / 300 MiB, for messages."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / MIB:.0f} MiB"


def normalize_bus_id(text: str) -> str:
    """'00000000:1B:00.0' (NVML, nvidia-smi) or '0000:1b:00.0' -> '0000:1b:00.0'."""
    m = re.match(r"^\s*(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F])\s*$", text)
    if not m:
        return text.strip().lower()
    domain = int(m.group(1) or "0", 16)
    return f"{domain:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4).lower()}"


def _run(cmd: Sequence[str], timeout: float = 20.0) -> Tuple[int, str]:
    """(exit status, stdout+stderr); (-1, why) when the command cannot run."""
    try:
        p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout, text=True)
    except (OSError, subprocess.SubprocessError) as e:
        return -1, str(e)
    return p.returncode, p.stdout


def nccl_search_path() -> str:
    """The folders where pip's NVIDIA wheels keep libnccl.so.2, for every sys.path entry that
    has one, joined with ':' (the value ddpc's C core reads from DDPC_NCCL_SEARCH_PATH)."""
    dirs: List[str] = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        for sub in ("nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
            d = os.path.join(entry, sub)
            if os.path.exists(os.path.join(d, "libnccl.so.2")) and d not in dirs:
                dirs.append(d)
    return ":".join(dirs)


def export_nccl_search_path() -> None:
    """Sets DDPC_NCCL_SEARCH_PATH (unless already set) so the C core finds the NCCL wheel that
    pip installed next to torch, also when ddpc itself is installed elsewhere (pip install -e)."""
    if not os.environ.get("DDPC_NCCL_SEARCH_PATH"):
        path = nccl_search_path()
        if path:
            os.environ["DDPC_NCCL_SEARCH_PATH"] = path


# ------------------------------------------------------------------------- NVML through ctypes


class _PciInfo(ctypes.Structure):
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint),
                ("bus", ctypes.c_uint), ("device", ctypes.c_uint),
                ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class _ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def _nvml_query() -> DriverInfo:
    """Device list and driver versions from libnvidia-ml.so.1. Processes come from nvidia-smi
    when it is there: NVML's process struct changed between drivers, the CLI did not."""
    info = DriverInfo(source="NVML")
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        info.error = f"libnvidia-ml.so.1 does not load ({e})"
        return info

    def check(ret: int, what: str) -> None:
        if ret != 0:
            nvml.nvmlErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {nvml.nvmlErrorString(ret).decode(errors='replace')}")

    try:
        check(nvml.nvmlInit_v2(), "nvmlInit_v2")
    except (RuntimeError, AttributeError) as e:
        info.error = f"NVML did not initialize ({e})"
        return info
    try:
        buf = ctypes.create_string_buffer(96)
        check(nvml.nvmlSystemGetDriverVersion(buf, 96), "nvmlSystemGetDriverVersion")
        info.driver = buf.value.decode()
        ver = ctypes.c_int(0)
        if nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(ver)) == 0:
            info.cuda = f"{ver.value // 1000}.{ver.value % 1000 // 10}"
        count = ctypes.c_uint(0)
        check(nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
        procs: List[GpuProcess] = []
        procs_ok = True
        for i in range(count.value):
            h = ctypes.c_void_p()
            check(nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)), "nvmlDeviceGetHandleByIndex")
            name = ctypes.create_string_buffer(96)
            check(nvml.nvmlDeviceGetName(h, name, 96), "nvmlDeviceGetName")
            uuid = ctypes.create_string_buffer(96)
            check(nvml.nvmlDeviceGetUUID(h, uuid, 96), "nvmlDeviceGetUUID")
            pci = _PciInfo()
            check(nvml.nvmlDeviceGetPciInfo_v3(h, ctypes.byref(pci)), "nvmlDeviceGetPciInfo_v3")
            mem = _Memory()
            check(nvml.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem)), "nvmlDeviceGetMemoryInfo")
            gpu = Gpu(i, name.value.decode(), uuid.value.decode(),
                      normalize_bus_id(pci.busId.decode()), mem.total, mem.free)
            info.gpus.append(gpu)
            n = ctypes.c_uint(64)
            arr = (_ProcessInfoV1 * 64)()
            if nvml.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(n), arr) == 0:
                procs += [GpuProcess(gpu.uuid, arr[k].pid, int(arr[k].usedGpuMemory))
                          for k in range(n.value)]
            else:
                procs_ok = False
        info.processes = procs if procs_ok else None
    except (RuntimeError, AttributeError) as e:
        info.error = f"NVML query failed ({e})"
    finally:
        nvml.nvmlShutdown()
    return info


def _smi_query() -> DriverInfo:
    """The same facts from nvidia-smi's CSV output."""
    info = DriverInfo(source="nvidia-smi")
    rc, out = _run(["nvidia-smi", "--query-gpu=index,name,uuid,pci.bus_id,memory.total,"
                    "memory.free,driver_version", "--format=csv,noheader,nounits"])
    if rc != 0:
        info.error = f"nvidia-smi failed ({out.strip()[:300]})"
        return info
    for row in out.strip().splitlines():
        cols = [c.strip() for c in row.split(",")]
        if len(cols) < 7:
            continue
        info.gpus.append(Gpu(int(cols[0]), cols[1], cols[2], normalize_bus_id(cols[3]),
                             int(float(cols[4])) * MIB, int(float(cols[5])) * MIB))
        info.driver = cols[6]
    rc, out = _run(["nvidia-smi"])
    m = re.search(r"CUDA Version:\s*([0-9.]+)", out) if rc == 0 else None
    info.cuda = m.group(1) if m else ""
    info.processes = _smi_processes()
    return info


def _smi_processes() -> Optional[List[GpuProcess]]:
    if not shutil.which("nvidia-smi"):
        return None
    rc, out = _run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory,process_name",
                    "--format=csv,noheader,nounits"])
    if rc != 0:
        return None
    procs = []
    for row in out.strip().splitlines():
        cols = [c.strip() for c in row.split(",", 3)]
        if len(cols) < 3 or not cols[1].isdigit():
            continue
        used = int(float(cols[2])) * MIB if re.match(r"^[0-9.]+$", cols[2]) else 0
        procs.append(GpuProcess(cols[0], int(cols[1]), used, cols[3] if len(cols) > 3 else ""))
    return procs


def query_driver() -> DriverInfo:
    """GPUs, driver and processes: NVML first, nvidia-smi when NVML is missing."""
    info = _nvml_query()
    if info.error and shutil.which("nvidia-smi"):
        smi = _smi_query()
        if not smi.error:
            return smi
        info.error += f"; {smi.error}"
    elif not info.error:
        smi_procs = _smi_processes()
        if smi_procs is not None:
            info.processes = smi_procs
    return info


# ------------------------------------------------------------------------- pure analysis


def visible_mapping(cvd: Optional[str], gpus: Sequence[Gpu]) -> Tuple[List[Gpu], str]:
    """The physical GPUs behind CUDA ordinals 0, 1, ... under CUDA_VISIBLE_DEVICES=cvd, and a note
    when the variable was cut short. Follows CUDA's rules: entries are indices or (prefixes of)
    UUIDs; the list ends at the first entry that names no GPU or repeats one."""
    if cvd is None:
        return list(gpus), ""
    out: List[Gpu] = []
    entries = [e.strip() for e in cvd.split(",")] if cvd.strip() else []
    for pos, e in enumerate(entries):
        gpu: Optional[Gpu] = None
        if re.fullmatch(r"\d+", e):
            idx = int(e)
            gpu = next((g for g in gpus if g.index == idx), None)
        elif e.startswith(("GPU-", "MIG-")):
            found = [g for g in gpus if g.uuid.startswith(e)]
            gpu = found[0] if len(found) == 1 else None
        if gpu is None or gpu in out:
            why = "repeats a GPU" if gpu is not None else "names no GPU of this machine"
            return out, (f"entry {pos} ({e!r}) {why}: CUDA ignores it and everything after it")
        out.append(gpu)
    return out, ""


def busy_verdict(gpus: Sequence[Gpu], procs: Sequence[GpuProcess],
                 own_pids: Sequence[int]) -> Tuple[str, str, Dict[int, List[GpuProcess]]]:
    """(kind, one-line verdict, {gpu index: other processes}) for the memory that processes
    other than own_pids hold on the given GPUs."""
    by_gpu: Dict[int, List[GpuProcess]] = {}
    for g in gpus:
        others = [p for p in procs if p.gpu_uuid == g.uuid and p.pid not in own_pids]
        if others:
            by_gpu[g.index] = others
    if not by_gpu:
        listed = ", ".join(str(g.index) for g in gpus)
        return "OK", f"no other process holds memory on GPU {listed}", by_gpu
    idx = sorted(by_gpu)
    held = sum(p.used for ps in by_gpu.values() for p in ps)
    npids = len({p.pid for ps in by_gpu.values() for p in ps})
    names = " and ".join([", ".join(str(i) for i in idx[:-1]), str(idx[-1])] if len(idx) > 1
                         else [str(idx[0])])
    verb = "are" if len(idx) > 1 else "is"
    return ("WARNING",
            f"GPU {names} {verb} busy: {fmt_bytes(held)} held by {npids} other "
            f"process{'es' if npids != 1 else ''} (choose free GPUs with CUDA_VISIBLE_DEVICES or "
            f"`python -m ddpc.launch --gpus auto`)",
            by_gpu)


def parse_topo(text: str) -> Dict[Tuple[int, int], str]:
    """{(i, j): link} from `nvidia-smi topo -m`: 'NV18' (18 NVLinks), 'PIX', 'PXB', 'PHB',
    'NODE', 'SYS' (PCIe paths, nearest first)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header: List[str] = []
    links: Dict[Tuple[int, int], str] = {}
    for ln in lines:
        tokens = ln.split()
        if not header and tokens and re.fullmatch(r"GPU\d+", tokens[0]) and "X" not in tokens:
            header = []
            for t in tokens:
                if not re.fullmatch(r"GPU\d+", t):
                    break
                header.append(t)
            continue
        if header and tokens and re.fullmatch(r"GPU\d+", tokens[0]):
            i = int(tokens[0][3:])
            for col, cell in zip(header, tokens[1:]):
                j = int(col[3:])
                if i != j:
                    links[(i, j)] = cell
    return links


def describe_link(link: str) -> Tuple[str, str]:
    """(kind, words) for a topo cell."""
    m = re.fullmatch(r"NV(\d+)", link)
    if m:
        return "OK", f"NVLink ({m.group(1)} links)"
    words = {"PIX": "PCIe through one switch", "PXB": "PCIe through several switches",
             "PHB": "PCIe through the host bridge (CPU)",
             "NODE": "PCIe across host bridges of one NUMA node",
             "SYS": "PCIe across NUMA nodes (slowest)"}
    return "NOTE", words.get(link, f"link type {link}")


# ------------------------------------------------------------------------- the checks


def check_build(rep: Report) -> None:
    rep.section("ddpc")
    rep.line(f"ddpc at {os.path.dirname(os.path.abspath(__file__))}, python {platform.python_version()}, "
             f"host {socket.gethostname()}")
    built = bool(_C.cuda_built())
    rep.line(f"CUDA support compiled in: {'yes (CUDA runtime linked statically)' if built else 'no'}")
    if not built:
        rep.verdict("NOTE", "this build has no CUDA support: only the cpu backend is available "
                            "(rebuild with the CUDA toolkit on PATH for the nccl backend)")


# ------------------------------------------------------------------------- environment

# Measured on 2 H200s (benchmarks/README.md, session 18, calls 1-3: GPT-2's step, paired scaling
# efficiency, one host, each setting in its own run). With NCCL's own choices over NVLink ddpc
# with bf16 gradients reached 0.94-0.96 and torch DDP 0.91.
_MEASURED = "measured on 2 H200s (GPT-2's step, benchmarks/README.md, session 18)"
_COSTS = {
    "NCCL_PROTO": "ddpc with bf16 gradients scaled 0.85 with LL128 and 0.92-0.95 with Simple, "
                  "torch DDP 0.77 and 0.87, against 0.94-0.96 and 0.91 with NCCL's own choice",
    "NCCL_ALGO": "with NCCL_ALGO=Tree NCCL refused an all_gather of bytes, which it has no tree "
                 "for: a collective that none of the listed algorithms can run fails",
    "NCCL_P2P_READ_ENABLE": "ddpc with bf16 gradients scaled 0.88-0.89 with it and torch DDP 0.78, "
                            "against 0.94-0.96 and 0.91 without",
    "NCCL_P2P_DISABLE": "ddpc with bf16 gradients scaled 0.91 with it and torch DDP 0.64, against "
                        "0.94-0.96 and 0.91 over NVLink",
}


def _truthy(value: str) -> bool:
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def env_verdicts(environ: Dict[str, str]) -> List[Tuple[str, str]]:
    """The verdicts on the settings in `environ` that change how NCCL, CUDA or ddpc work: DDPC_*
    values that are not settings (init_process_group refuses them) and DDPC_* names ddpc does
    not read, those that measurably slowed training here, one that serializes the GPU, and a
    list of the rest."""
    def get(name: str) -> str:
        return environ.get(name, "").strip()

    p2p = get("NCCL_P2P_DISABLE")
    p2p_off = _C.nccl_p2p_off(p2p or None, get("NCCL_P2P_LEVEL") or None)  # "NAME=value" or None

    def measured(name: str, advice: str) -> str:
        return f"{_MEASURED}: {_COSTS[name]}. {advice}"

    keep = "Unset it unless you measured a gain on this machine"
    # (name, whether its value matters here, kind, text)
    checks = [
        ("NCCL_PROTO", bool(get("NCCL_PROTO")), "WARNING",
         f"NCCL_PROTO={get('NCCL_PROTO')} limits the protocols NCCL may pick; "
         + measured("NCCL_PROTO", keep)),
        ("NCCL_ALGO", bool(get("NCCL_ALGO")), "WARNING",
         f"NCCL_ALGO={get('NCCL_ALGO')} limits the algorithms NCCL may pick; "
         + measured("NCCL_ALGO", keep)),
        ("NCCL_P2P_READ_ENABLE", get("NCCL_P2P_READ_ENABLE") == "0", "WARNING",
         "NCCL_P2P_READ_ENABLE=0 makes NCCL write into its peers instead of reading from them; "
         + measured("NCCL_P2P_READ_ENABLE", "Unset it")),
        ((p2p_off or "NCCL_P2P_DISABLE").split("=")[0], p2p_off is not None, "WARNING",
         f"{p2p_off}: the GPUs exchange data through host memory; "
         + measured("NCCL_P2P_DISABLE", "Unset it unless P2P is broken between these GPUs")),
        # NCCL turns P2P off only for the number 1 (and so does ddpc, after it)
        ("NCCL_P2P_DISABLE", bool(p2p) and p2p_off is None and p2p != "0", "WARNING",
         f"NCCL_P2P_DISABLE={p2p} leaves P2P on: NCCL reads the value as a number and turns P2P "
         f"off only for 1. Set NCCL_P2P_DISABLE=1 to turn it off, or unset it"),
        ("CUDA_LAUNCH_BLOCKING", _truthy(get("CUDA_LAUNCH_BLOCKING")), "WARNING",
         f"CUDA_LAUNCH_BLOCKING={get('CUDA_LAUNCH_BLOCKING')}: every kernel launch waits for the "
         f"kernel to finish, so gradients are no longer reduced while the backward runs. Set it "
         f"only to find which kernel failed"),
        ("NCCL_DEBUG", get("NCCL_DEBUG").upper() in ("INFO", "TRACE"), "NOTE",
         f"NCCL_DEBUG={get('NCCL_DEBUG')}: NCCL logs every communicator it sets up; useful to "
         f"find a problem, noisy in a training run"),
    ]
    bad, unknown = _settings.bad_values(environ), _settings.unknown_names(environ)
    unknown += _settings.misspelt_visible_devices(environ)
    out = [("PROBLEM", text) for _, text in bad] + [("WARNING", text) for _, text in unknown]
    out += [(kind, text) for _, on, kind, text in checks if on]
    flagged = {name for name, on, _, _ in checks if on} | {name for name, _ in bad + unknown}
    # (NCCL_RUNTIME_CONNECT=0 is ddpc's own default, set when it is imported: ddpc/distributed.py;
    # NCCL_VERSION is a label NVIDIA's containers carry, which NCCL does not read)
    rest = sorted(f"{k}={v}" for k, v in environ.items()
                  if k.startswith(("NCCL_", "DDPC_")) and k not in flagged
                  and (k, v) != ("NCCL_RUNTIME_CONNECT", "0") and k != "NCCL_VERSION")
    if rest:
        out.append(("NOTE", "also set (these tune NCCL or ddpc away from their defaults; "
                            "README.md lists ddpc's): " + ", ".join(rest)))
    if not out:
        out.append(("OK", "no NCCL_*, DDPC_* or CUDA_LAUNCH_BLOCKING settings: NCCL and ddpc "
                          "choose for themselves"))
    return out


def check_env(rep: Report, environ: Dict[str, str]) -> None:
    rep.section("Environment")
    for kind, text in env_verdicts(environ):
        rep.verdict(kind, text)


# ------------------------------------------------------------------------- host CPUs


@dataclass
class CpuTimes:
    """One line of /proc/stat, in clock ticks since boot."""

    busy: int    # user, nice, system, irq, softirq
    idle: int    # idle, iowait
    steal: int   # time the hypervisor ran something else while this (virtual) CPU wanted to run


def parse_proc_stat(text: str) -> Dict[str, CpuTimes]:
    """The 'cpu' (all CPUs) and 'cpuN' lines of /proc/stat. Fields past those the kernel has
    (steal came in 2.6.11) count as 0; guest time is already inside user and nice."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].startswith("cpu"):
            continue
        try:
            v = [int(x) for x in parts[1:]] + [0] * 8
        except ValueError:
            continue
        out[parts[0]] = CpuTimes(busy=v[0] + v[1] + v[2] + v[5] + v[6], idle=v[3] + v[4],
                                 steal=v[7])
    return out


def read_cpu_times() -> Optional[CpuTimes]:
    """The 'cpu' line (all CPUs) of /proc/stat now; None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            return parse_proc_stat(f.read()).get("cpu")
    except OSError:
        return None


def host_load(before: CpuTimes, after: CpuTimes, own_ticks: float,
              ncpus: int) -> Tuple[float, float]:
    """(CPUs that work other than own_ticks kept busy on average, share of the CPUs' time that
    the hypervisor stole) between two readings of the 'cpu' line."""
    busy = after.busy - before.busy
    steal = after.steal - before.steal
    total = busy + (after.idle - before.idle) + steal
    if total <= 0:
        return 0.0, 0.0
    others = max(0.0, busy - own_ticks) / total * ncpus
    return others, steal / total


def python_probe_ms() -> float:
    """ms that a fixed piece of pure-Python work (the kind a training step's host side does:
    calls, dicts, integers) takes on this thread now."""
    t0 = time.perf_counter()
    s, d = 0, {}
    for i in range(20000):
        s += i * 3 % 7
        d[i & 255] = s
    return (time.perf_counter() - t0) * 1e3


def host_verdicts(others: float, steal: float, ncpus: int,
                  probes: Sequence[float]) -> List[Tuple[str, str]]:
    """The verdicts on a host sample: other work's CPUs, the hypervisor's share, the spread of
    the probe's times."""
    out = []
    if steal >= 0.05:
        out.append(("WARNING", f"the hypervisor took {steal:.0%} of these CPUs' time (steal): "
                               f"this is a shared virtual machine, and a training step whose "
                               f"host side is its bottleneck slows down and varies with it"))
    elif steal >= 0.01:
        out.append(("NOTE", f"the hypervisor took {steal:.1%} of these CPUs' time (steal)"))
    if others >= max(1.0, 0.5 * ncpus):
        out.append(("WARNING", f"other work kept {others:.1f} of the {ncpus} CPUs busy: the "
                               f"ranks' Python competes with it (see top)"))
    elif others >= 1.0:
        out.append(("NOTE", f"other work kept {others:.1f} of the {ncpus} CPUs busy"))
    if len(probes) >= 5:
        # (the 10th and 90th percentiles: one run that a context switch cut in two is no verdict)
        srt = sorted(probes)
        p10, p90 = srt[len(srt) // 10], srt[(len(srt) * 9) // 10]
        if p90 >= 1.5 * p10:
            out.append(("NOTE", f"a fixed piece of Python took {p10:.2f} ms or less in a tenth "
                                f"of its runs and {p90:.2f} ms or more in another tenth: this "
                                f"host's CPU speed varies, and so will step times; compare "
                                f"settings on one host, interleaved (as benchmarks/ddp_step.py "
                                f"does)"))
    if not out:
        out.append(("OK", "the host's CPUs were steady, and free of other work"))
    return out


def check_host(rep: Report, seconds: float) -> None:
    rep.section("Host CPUs")
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    online = os.cpu_count() or usable
    rep.line(f"{usable} CPU(s) usable by this process, of {online} online "
             f"({platform.machine()}{', ' + platform.processor() if platform.processor() else ''})")
    if seconds <= 0:
        rep.verdict("NOTE", "skipped the host sample (--host-seconds 0)")
        return
    before = read_cpu_times()
    t0 = time.monotonic()
    r0 = os.times()
    probes = []
    while time.monotonic() - t0 < seconds or len(probes) < 5:
        probes.append(python_probe_ms())
    r1 = os.times()
    after = read_cpu_times() if before is not None else None
    srt = sorted(probes)
    rep.line(f"a fixed piece of Python, {len(probes)} times in {time.monotonic() - t0:.1f} s: "
             f"{srt[0]:.2f} ms fastest, {srt[len(srt) // 2]:.2f} median, {srt[-1]:.2f} slowest")
    others, steal = 0.0, 0.0
    if before is None or after is None:
        rep.verdict("NOTE", "could not read the CPUs' times from /proc/stat: other work and "
                            "steal were not measured")
    else:
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        own = ((r1.user - r0.user) + (r1.system - r0.system)) * tick
        others, steal = host_load(before, after, own, online)
        rep.line(f"meanwhile other work kept {others:.1f} of {online} CPUs busy, and the "
                 f"hypervisor took {steal:.1%} of their time (steal)")
    for kind, text in host_verdicts(others, steal, online, probes):
        rep.verdict(kind, text)


def check_driver(rep: Report) -> DriverInfo:
    rep.section("NVIDIA driver and GPUs")
    info = query_driver()
    if info.error and not info.gpus:
        rep.line(f"no NVIDIA driver answered: {info.error}; nvidia-smi "
                 f"{'is' if shutil.which('nvidia-smi') else 'is not'} on PATH")
        rep.verdict("NOTE", "no GPU and no NVIDIA driver on this machine: ddpc will use the cpu "
                            "backend (init_process_group() picks it; backend='nccl' would fail)")
        return info
    rep.line(f"driver {info.driver or '?'}, supports CUDA up to {info.cuda or '?'} (from {info.source})")
    if not info.gpus:
        rep.verdict("NOTE", "the driver sees no GPU: ddpc will use the cpu backend")
        return info
    for g in info.gpus:
        rep.line(f"GPU {g.index}: {g.name}, bus {g.bus_id}, {fmt_bytes(g.mem_total)} total, "
                 f"{fmt_bytes(g.mem_free)} free, {g.uuid}")
    if info.processes is None:
        rep.verdict("NOTE", "could not list the processes on the GPUs (neither nvidia-smi "
                            "--query-compute-apps nor NVML answered)")
    else:
        kind, text, by_gpu = busy_verdict(info.gpus, info.processes, [os.getpid()])
        for idx, procs in sorted(by_gpu.items()):
            for p in procs:
                who = p.name or _proc_name(p.pid)
                rep.line(f"GPU {idx}: pid {p.pid} {who} holds {fmt_bytes(p.used)}")
        rep.verdict(kind, text)
    return info


def _proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "(not visible from here: another container or user)"


def check_visible(rep: Report, info: DriverInfo, torch: Any) -> List[Gpu]:
    rep.section("CUDA_VISIBLE_DEVICES")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = _C.cuda_device_count() if _C.cuda_built() else 0
    rep.line(f"CUDA_VISIBLE_DEVICES={cvd if cvd is not None else '<unset>'}; "
             f"ddpc sees {count} CUDA device{'s' if count != 1 else ''}")
    visible, note = visible_mapping(cvd, info.gpus)
    if note:
        rep.verdict("WARNING", f"CUDA_VISIBLE_DEVICES: {note}")
    for i, g in enumerate(visible):
        rep.line(f"cuda:{i} -> GPU {g.index} ({g.name}, bus {g.bus_id})")
    if torch is not None and count:
        for i in range(min(count, len(visible))):
            props = torch.cuda.get_device_properties(i)
            bus = getattr(props, "pci_bus_id", None)
            if bus is None:
                break
            tbus = normalize_bus_id(f"{getattr(props, 'pci_domain_id', 0):x}:{bus:x}:"
                                    f"{getattr(props, 'pci_device_id', 0):x}.0")
            if tbus != visible[i].bus_id:
                rep.verdict("WARNING", f"cuda:{i} is bus {tbus} for CUDA but the mapping above says "
                                       f"{visible[i].bus_id}: set CUDA_DEVICE_ORDER=PCI_BUS_ID so "
                                       "CUDA numbers GPUs like nvidia-smi")
                break
    if info.gpus and count != len(visible) and _C.cuda_built():
        rep.verdict("WARNING", f"the driver lists {len(visible)} visible GPU(s) but CUDA sees "
                               f"{count}: another process may hold a GPU in exclusive mode, or the "
                               "driver and CUDA disagree (see the driver version above)")
    elif info.gpus and count:
        rep.verdict("OK", f"{count} GPU(s) usable; `python -m ddpc.launch --nproc-per-node {count}` "
                          "gives each rank its own")
    return visible


def check_nccl(rep: Report, torch: Any) -> Optional[str]:
    rep.section("NCCL")
    export_nccl_search_path()
    try:
        version = _C.nccl_version()
    except _C.DistributedError as e:
        kind = "PROBLEM" if _C.cuda_built() and _C.cuda_device_count() > 0 else "NOTE"
        rep.verdict(kind, f"NCCL is not available, so the nccl backend is not either: {e}")
        return None
    path = next((ln.split()[-1] for ln in _read_maps() if "libnccl" in ln), "?")
    rep.line(f"ddpc uses NCCL {version} from {path}")
    if torch is not None and torch.cuda.is_available():
        try:
            tv = ".".join(str(x) for x in torch.cuda.nccl.version())
            rep.line(f"torch {torch.__version__} (CUDA {torch.version.cuda}) uses NCCL {tv}")
        except (AttributeError, RuntimeError, TypeError):
            pass
    rep.verdict("OK", f"NCCL {version} loads")
    return version


def _read_maps() -> List[str]:
    try:
        with open("/proc/self/maps") as f:
            return f.read().splitlines()
    except OSError:
        return []


def check_p2p(rep: Report, visible: Sequence[Gpu], torch: Any) -> None:
    if len(visible) < 2:
        return
    rep.section("Peer-to-peer between GPUs")
    links: Dict[Tuple[int, int], str] = {}
    if shutil.which("nvidia-smi"):
        rc, out = _run(["nvidia-smi", "topo", "-m"])
        if rc == 0:
            links = parse_topo(out)
    for a in range(len(visible)):
        for b in range(a + 1, len(visible)):
            ga, gb = visible[a], visible[b]
            link = links.get((ga.index, gb.index))
            kind, words = describe_link(link) if link else ("NOTE", "link type unknown")
            p2p = ""
            if torch is not None and torch.cuda.is_available():
                ok = torch.cuda.can_device_access_peer(a, b) and torch.cuda.can_device_access_peer(b, a)
                p2p = ", P2P access yes" if ok else ", P2P access NO"
                if not ok:
                    kind = "WARNING"
            text = f"cuda:{a} and cuda:{b}: {words}{p2p}"
            if kind == "WARNING":
                text += " (NCCL copies through host memory: expect a few GB/s)"
            rep.verdict(kind, text)


# ------------------------------------------------------------------------- bandwidth test


def _time_loop(torch: Any, once: Any, iters: int) -> float:
    """Seconds per call of once(), after 3 warm-up calls, with the device drained around it."""
    for _ in range(3):
        once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _bench_worker(rank: int, world: int, port: int, token: str, torch_port: int, nbytes: int,
                  iters: int, timeout: float, queue: Any) -> None:
    """One rank of the all-reduce measurement (runs in a spawned process): ddpc's nccl backend,
    then torch.distributed's on the same data, for comparison."""
    result: Dict[str, Any] = {"rank": rank}
    try:
        import torch
        _C.cuda_set_device(rank)
        torch.cuda.set_device(rank)
        store = _C.Store("127.0.0.1", port, token, rank, timeout)
        group = _C.Group(store, rank, world, backend="nccl", timeout=timeout, prefix="doctor",
                         device=rank)
        n = nbytes // 4
        x = torch.ones(n, dtype=torch.float32, device=f"cuda:{rank}")
        stream = torch.cuda.current_stream().cuda_stream

        def once() -> None:
            # all_reduce (0) of float32 (0) with avg (1): the values stay 1.0, so they can be checked.
            w = group.post(0, 0, x.data_ptr(), n, 0, 1, 0, rank, stream, x)
            w.wait(stream, True)

        result["seconds"] = _time_loop(torch, once, iters)
        result["correct"] = bool(torch.all(x == 1.0).item())
        result["fast_max_bytes"] = group.fast_max_bytes
        result["staged_min_bytes"] = group.staged_min_bytes
        group.destroy()
        store.close()
        import torch.distributed as dist
        if dist.is_available() and dist.is_nccl_available():
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{torch_port}",
                                    rank=rank, world_size=world,
                                    device_id=torch.device("cuda", rank))
            result["torch_seconds"] = _time_loop(
                torch, lambda: dist.all_reduce(x, op=dist.ReduceOp.AVG), iters)
            dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which prints it
        result["error"] = f"{type(e).__name__}: {e}"
    queue.put(result)


def check_bandwidth(rep: Report, visible: Sequence[Gpu], nccl: Optional[str], torch: Any,
                    mib: int, timeout: float) -> None:
    rep.section("All-reduce bandwidth (ddpc nccl backend)")
    if len(visible) < 2 or _C.cuda_device_count() < 2:
        rep.verdict("NOTE", "skipped: it needs 2 GPUs")
        return
    if nccl is None or torch is None:
        rep.verdict("NOTE", f"skipped: it needs {'NCCL' if nccl is None else 'torch'} "
                            "(for device memory)")
        return
    import multiprocessing as mp
    import secrets
    ctx = mp.get_context("spawn")
    token = secrets.token_hex(16)
    server = _C.StoreServer("127.0.0.1", 0, token)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        torch_port = s.getsockname()[1]
    queue = ctx.Queue()
    nbytes, iters = mib * MIB, 20
    procs = [ctx.Process(target=_bench_worker,
                         args=(r, 2, server.port, token, torch_port, nbytes, iters, timeout,
                               queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results: List[Dict[str, Any]] = []
    deadline = time.monotonic() + timeout + 30
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                results.append(queue.get(timeout=1.0))
            except Exception:  # queue.Empty: keep waiting while the workers live
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        server.stop()
    errors = [f"rank {r['rank']}: {r['error']}" for r in results if "error" in r]
    if errors or len(results) < 2:
        missing = 2 - len(results)
        why = "; ".join(errors) or f"{missing} worker(s) gave no result within {timeout:.0f} s"
        rep.verdict("PROBLEM", f"the all-reduce between cuda:0 and cuda:1 failed: {why}")
        return
    seconds = max(r["seconds"] for r in results)
    algbw = nbytes / seconds / 1e9
    busbw = algbw * 2 * (2 - 1) / 2
    rep.line(f"{mib} MiB float32 all-reduce (avg), {iters} iterations: {seconds * 1e3:.2f} ms each, "
             f"algbw {algbw:.1f} GB/s, busbw {busbw:.1f} GB/s")
    ratio = None
    if all("torch_seconds" in r for r in results):
        tsec = max(r["torch_seconds"] for r in results)
        ratio = tsec / seconds
        rep.line(f"torch.distributed (nccl) on the same data: {tsec * 1e3:.2f} ms each, busbw "
                 f"{nbytes / tsec / 1e9:.1f} GB/s; ddpc/torch speed ratio {ratio:.2f}")
    if not all(r["correct"] for r in results):
        rep.verdict("PROBLEM", "the all-reduce returned wrong values")
    elif ratio is not None and ratio < 0.8:
        rep.verdict("WARNING", f"ddpc's all-reduce runs at {ratio:.2f}x torch's on the same GPUs")
    elif busbw < 10:
        rep.verdict("WARNING", f"busbw {busbw:.1f} GB/s is low for two GPUs of one host: check "
                               "P2P above and NCCL_P2P_DISABLE / NCCL_SHM_DISABLE in the environment")
    else:
        rep.verdict("OK", f"cuda:0 <-> cuda:1 all-reduce runs at {busbw:.1f} GB/s bus bandwidth")
    fast = min(r.get("fast_max_bytes", 0) for r in results)
    if fast:
        rep.verdict("OK", f"small all-reduces (up to {fast // 1024} KiB) take ddpc's one-shot "
                          "kernel over CUDA IPC, a few microseconds each")
    else:
        rep.verdict("NOTE", "small all-reduces go through NCCL (the one-shot kernel is off: "
                            "NCCL_P2P_DISABLE, DDPC_FAST_ALLREDUCE=0, no P2P between the GPUs, or "
                            "ranks on different hosts; DDPC_DEBUG=INFO says which)")
    staged = min(r.get("staged_min_bytes", 0) for r in results)
    if staged:
        rep.verdict("OK", f"all-reduces of {staged // 1024} KiB or more go through pinned host "
                          "memory on the copy engines (ddpc's staged path: P2P is off)")


# ------------------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs every check and prints the report; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m ddpc.doctor", description=__doc__.split("\n")[0])
    ap.add_argument("--no-bench", action="store_true", help="skip the all-reduce bandwidth test")
    ap.add_argument("--bench-mib", type=int, default=64, help="all-reduce size in MiB (default 64)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds the bandwidth test may take (default 120)")
    ap.add_argument("--host-seconds", type=float, default=1.0,
                    help="seconds to sample the host's CPUs (default 1; 0 skips it)")
    args = ap.parse_args(argv)
    if args.bench_mib < 1:
        ap.error(f"--bench-mib must be >= 1, got {args.bench_mib}")
    if args.timeout <= 0:
        ap.error(f"--timeout must be positive, got {args.timeout}")
    if not 0 <= args.host_seconds <= 600:
        ap.error(f"--host-seconds must be between 0 and 600, got {args.host_seconds}")

    environ = dict(os.environ)  # before export_nccl_search_path adds to it
    rep = Report()
    print("ddpc doctor")
    check_build(rep)
    check_env(rep, environ)
    info = check_driver(rep)
    torch = None
    if info.gpus:
        try:
            import torch as _torch  # after the process listing: torch may create CUDA contexts
            torch = _torch if _torch.cuda.is_available() else None
        except ImportError:
            torch = None
    visible = check_visible(rep, info, torch) if info.gpus else []
    nccl = check_nccl(rep, torch)
    check_p2p(rep, visible, torch)
    if not args.no_bench:
        check_bandwidth(rep, visible, nccl, torch, args.bench_mib, args.timeout)
    check_host(rep, args.host_seconds)

    rep.section("Summary")
    usable = _C.cuda_device_count() if _C.cuda_built() else 0
    if usable and nccl:
        rep.line(f"ddpc can use the nccl backend on {usable} GPU(s)")
    else:
        reason = ("no GPU is visible" if not usable else "NCCL is missing")
        rep.line(f"ddpc will use the cpu backend: {reason}")
    rep.line(f"{rep.problems} problem(s), {rep.warnings} warning(s)")
    return 1 if rep.problems else 0


if __name__ == "__main__":
    sys.exit(main())
