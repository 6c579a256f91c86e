"""``specdecode env``: the machine as the backends see it, and how llama.cpp's weights load here."""

from __future__ import annotations

import argparse
import platform

# The CPU flags that decide which kernels run: llama.cpp's repack and AMX, torch's bf16.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def add_env_parser(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser(
        "env",
        help="show the CPU, the library versions and how llama.cpp's weights load here",
        description=(
            "Print the CPU, its kernel flags, the library versions and the llama.cpp repack choice: whether "
            "GGUF weights load repacked for the fastest CPU kernels (on), repacked without AMX, or not at all "
            "(off), and why. On a CPU with AMX the first llama.cpp load probes whether AMX works; --gguf runs "
            "that probe now, on the given file."
        ),
    )
    env.add_argument("--gguf", default=None, metavar="FILE",
                     help="a GGUF file to probe AMX with, if this machine has AMX and has not been probed")


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    from specdecode import __version__
    from specdecode.backends.llamacpp_binding import BackendUnavailableError, import_llama_cpp, physical_core_count
    from specdecode.backends.llamacpp_repack import (
        AMX_FLAG,
        extra_buffer_names,
        llama_cpp_version,
        repack_choice,
        verdict_path,
    )
    from specdecode.core.device import cpu_flags, cpu_model

    flags = cpu_flags()
    print(f"specdecode {__version__}, Python {platform.python_version()}, torch {torch.__version__}, "
          f"llama-cpp-python {llama_cpp_version()}")
    print(f"cpu: {cpu_model()}, {physical_core_count()} physical cores for this process")
    print(f"cpu flags: {' '.join(flag for flag in KERNEL_FLAGS if flag in flags) or 'none of ' + ' '.join(KERNEL_FLAGS)}")
    try:
        names = extra_buffer_names(import_llama_cpp())
        listed = "not readable from this binding" if names is None else ", ".join(names) or "none"
        print(f"llama.cpp extra buffer types: {listed}")
    except BackendUnavailableError:
        print("llama.cpp: llama-cpp-python is not installed")
    print(f"llama.cpp {repack_choice(args.gguf, show_progress=True).describe()}")
    if AMX_FLAG in flags:
        path = verdict_path()
        print(f"AMX verdict: {path}" + ("" if path.is_file() else " (none stored yet)"))
    return 0
