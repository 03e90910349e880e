"""The DDPC_* environment settings, as the C core's table (csrc/settings.c) knows them: which
values in an environment are not settings, and which DDPC_* names ddpc does not read at all
(a typo means the setting silently has no effect), and a misspelt CUDA_VISIBLE_DEVICES (which
hides no GPU, so every rank sees them all). Used by the doctor and the launchers."""
from __future__ import annotations

import difflib
from typing import Dict, List, Mapping, Tuple

from . import _C


def known() -> Dict[str, str]:
    """{name: what it does} for every DDPC_* setting ddpc reads."""
    return dict(_C.settings())


def bad_values(environ: Mapping[str, str]) -> List[Tuple[str, str]]:
    """(name, message) for each DDPC_* setting in `environ` whose value is not one (the message
    says what it takes), in name order. init_process_group and wrap_model refuse these."""
    out = []
    for name in sorted(known()):
        value = environ.get(name)
        if value:
            try:
                _C.check_setting(name, value)
            except ValueError as e:
                out.append((name, str(e)))
    return out


def unknown_names(environ: Mapping[str, str]) -> List[Tuple[str, str]]:
    """(name, message) for each DDPC_* name in `environ` that ddpc does not read; the message
    names the setting it most likely meant."""
    names = known()
    out = []
    for name in sorted(k for k in environ if k.startswith("DDPC_") and k not in names):
        close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        out.append((name, f"{name} is not a ddpc setting, so it changes nothing{hint}; "
                          f"README.md lists ddpc's settings"))
    return out


def misspelt_visible_devices(environ: Mapping[str, str]) -> List[Tuple[str, str]]:
    """(name, message) for each variable in `environ` that looks like CUDA_VISIBLE_DEVICES but
    is not it (CUDA_VISIBLE_DEVICE, cuda_visible_devices, ...): CUDA reads only the exact name,
    so such a variable hides no GPU, and the job runs on GPUs it was meant to leave alone."""
    want = "CUDA_VISIBLE_DEVICES"
    out = []
    for name in sorted(environ):
        up = name.upper()
        if (name != want and up.startswith("CUDA_")
                and difflib.SequenceMatcher(None, up, want).ratio() >= 0.9):
            value = environ[name]
            out.append((name, f"{name}={value} is not CUDA's setting ({want}), so it hides no "
                              f"GPU: rename it to {want}, or pick the GPUs with "
                              f"`python -m ddpc.launch --gpus {value or '0,1'}`"))
    return out
