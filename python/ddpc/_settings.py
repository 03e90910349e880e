"""The DDPC_* environment settings, as the C core's table (csrc/settings.c) knows them: which
values in an environment are not settings, and which DDPC_* names ddpc does not read at all
(a typo means the setting silently has no effect). Used by the doctor and the launchers."""
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
