"""Run ``python -m MODULE ARGS`` under a seccomp allow list, as systemd applies a unit's SystemCallFilter=.

    python seccomp_run.py ALLOWED_FILE MODULE [ARGS...]
    python seccomp_run.py ALLOWED_FILE -c CODE

ALLOWED_FILE holds one system call name per line. Every other call fails with EPERM
(SystemCallErrorNumber=EPERM); the filter sets no_new_privs and is inherited by every child, vLLM's
included. libseccomp through ctypes: the shared library systemd itself uses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import runpy
import sys

SCMP_ACT_ALLOW = 0x7FFF0000


def scmp_act_errno(code: int) -> int:
    return 0x00050000 | (code & 0x0000FFFF)


def apply(names: list[str]) -> int:
    """Load the filter; how many of ``names`` this architecture knows."""
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(scmp_act_errno(errno.EPERM))
    if not ctx:
        raise OSError("seccomp_init failed")
    known = 0
    for name in names:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a call of this architecture (a 32-bit variant, say)
            continue
        rc = lib.seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0)
        if rc != 0:
            raise OSError(-rc, f"seccomp_rule_add({name})")
        known += 1
    rc = lib.seccomp_load(ctx)
    if rc != 0:
        raise OSError(-rc, "seccomp_load")
    return known


def main() -> None:
    allowed_file, module, *args = sys.argv[1:]
    with open(allowed_file, encoding="utf-8") as f:
        names = [line.strip() for line in f if line.strip()]
    apply(names)
    if module == "-c":
        exec(compile(args[0], "<seccomp_run -c>", "exec"), {"__name__": "__main__"})
        return
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
