"""CMAKE_ARGS for building llama-cpp-python from source on this host (`make` runs it as a script, before any venv:
no imports from the project). ggml's native build (-march=native) can enable instruction sets it then misuses (AMX
tiles where the kernel lacks permission to use them: Illegal instruction), so on x86 each set is named from
/proc/cpuinfo instead, and AMX stays off. Elsewhere (ARM) the native build is left as it is."""

from __future__ import annotations

import sys

# /proc/cpuinfo's flag for each ggml option, in the order ggml lists them.
X86_OPTIONS = (("sse4_2", "GGML_SSE42"), ("avx", "GGML_AVX"), ("avx_vnni", "GGML_AVX_VNNI"), ("avx2", "GGML_AVX2"),
               ("bmi2", "GGML_BMI2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"), ("avx512f", "GGML_AVX512"),
               ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
               ("avx512_bf16", "GGML_AVX512_BF16"))
# What the project needs of the package: the library, not llava's (multimodal), whose build doubles the time.
COMMON = ("-DLLAVA_BUILD=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def cpu_flags(cpuinfo: str) -> set[str] | None:
    """The first processor's flags, or None where there is no x86 `flags` line (ARM says `Features`)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return None


def cmake_args(cpuinfo: str) -> list[str]:
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return list(COMMON)
    named = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in X86_OPTIONS]
    return ["-DGGML_NATIVE=OFF", *named, *COMMON]


def main() -> None:
    try:
        with open("/proc/cpuinfo") as file:
            cpuinfo = file.read()
    except OSError:
        cpuinfo = ""
    sys.stdout.write(" ".join(cmake_args(cpuinfo)) + "\n")


if __name__ == "__main__":
    main()
