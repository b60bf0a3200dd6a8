"""Target presets: data, one JSON file per preset (installed as mhagen.targets).

Fields: name, description, tvm (the TVM target dict; "mcpu": "host" means this machine's CPU),
arch (the ISA the code runs on), cores ("host" = this machine's usable cores),
vector_bits (null = derived from the CPU's features), vector_registers (null = derived: 32 on
aarch64 and with AVX-512, else 16), cross_compiler (null = the host's cc; else the g++ that
links kernel.so for another arch, e.g. aarch64-linux-gnu-g++). cores: "host" or a number.
l1d_kib, l2_kib, l3_kib (optional): cache sizes for cache blocking; absent = this machine's
(sysfs) when the preset is for this machine's arch, else 32 / 1024 / 0.
fallback (optional): the CPU features the preset's code needs (LLVM's names, as
Target.required_features() lists them; [] for "this machine's CPU"): a module refused on a
CPU suggests the presets of its arch whose features that CPU has (tests check the list).
family, device (optional): the backend (mhagen/backends.py) and where kernels run; GPU presets
(family "cuda", device "cuda", arch "cuda") give a TVM target of another kind than llvm, the
GPU's limits as TVM names them, and cores = streaming multiprocessors.
"""
import json
from importlib import resources


def preset_names() -> list:
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".json"))


def load_preset(name: str) -> dict:
    path = resources.files(__name__) / f"{name}.json"
    if not path.is_file():
        raise KeyError(name)
    return json.loads(path.read_text())
