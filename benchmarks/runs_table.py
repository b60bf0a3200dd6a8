"""The README's table of every committed x86 run of bench_mha.py, newest first, computed
from the results folders (benchmarks/results/x86_64-*/results.json):

    python benchmarks/runs_table.py        # paste its output under README's Performance

Per run: the rows (of 16) where mhagen / fastest peer rounds to 1.00 or less and the range
of that ratio (medians); mhagen's share of the sgemm peak on the unmasked rows at
seq >= 512, at 1 / 2 threads; the same count against ONNX Runtime alone. Runs of the
x86-avx2 preset on an AVX-512 host are compared with the peers held to AVX2 (torch, numpy);
ONNX Runtime keeps its AVX-512 kernels there. A folder is named CLASS_on_HOST[_suffix]."""
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
AVX2_PEERS = ("numpy", "torch_mha", "torch_sdpa")
ORT = ("ort_mha", "ort_attention")
CPUS = {"skylake-avx512": "Intel Skylake-SP", "znver3": "AMD Zen 3", "znver4": "AMD Zen 4",
        "znver5": "AMD Zen 5",
        # an Intel Xeon with AMX and AVX512-FP16 (Sapphire Rapids or later) whose hypervisor
        # reports model 167, which LLVM names rocketlake
        "rocketlake": "Intel Xeon with AMX"}
HEADER = ("| results | date | CPU: class | peers | rows <= 1.00 | mhagen / fastest peer "
          "| % sgemm peak | rows <= ONNX Runtime |\n|---|---|---|---|---:|---:|---:|---:|")


def _fastest(group, impls):
    return min(group[i]["median_ms"] for i in impls if group.get(i, {}).get("median_ms"))


def run_line(folder: Path) -> tuple:
    """(date, table line) of one results folder."""
    data = json.loads((folder / "results.json").read_text())
    cls, host = folder.name.split("_on_")
    cpu = next(name for llvm, name in CPUS.items() if host.startswith(llvm))
    avx2_only_host = host.startswith("znver3")
    via_preset = "v256" in cls and not avx2_only_host
    peers = AVX2_PEERS if via_preset else AVX2_PEERS + ORT
    groups = {}
    for r in data["rows"]:
        groups.setdefault((r["threads"], r["shape"], r["mask"]), {})[r["impl"]] = r
    ratios = [round(g["mhagen"]["median_ms"] / _fastest(g, peers), 2) for g in groups.values()]
    to_ort = [round(g["mhagen"]["median_ms"] / _fastest(g, ORT), 2) for g in groups.values()]
    shares = " / ".join(
        "{:.0f}-{:.0f}%".format(100 * min(s.values()), 100 * max(s.values()))
        for s in (data["summary"][t]["mhagen_peak_share_seq512_nomask"] for t in ("1", "2")))
    how = ("AVX2 on real AVX2-only hardware" if avx2_only_host else
           "AVX2 through `x86-avx2`" if via_preset else "AVX-512")
    date = data["meta"]["date"][:10]
    line = (f"| [{folder.name}](benchmarks/results/{folder.name}/results.md) | {date} "
            f"| {cpu}: {how} | {'torch, numpy (AVX2)' if via_preset else 'all'} "
            f"| {sum(x <= 1.0 for x in ratios)} of {len(ratios)} "
            f"| {min(ratios):.2f}-{max(ratios):.2f} | {shares} "
            f"| {sum(x <= 1.0 for x in to_ort)} of {len(to_ort)} "
            f"({min(to_ort):.2f}-{max(to_ort):.2f}) |")
    return data["meta"]["date"], line


def table(results: Path = RESULTS) -> str:
    lines = sorted((run_line(f) for f in results.glob("x86_64-*") if f.is_dir()),
                   reverse=True)
    return "\n".join([HEADER] + [line for _, line in lines])


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
