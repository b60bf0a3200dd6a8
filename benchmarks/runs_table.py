"""The table of every committed x86 run of bench_mha.py (benchmarks/PERFORMANCE.md, "Every
x86 run"), newest first, computed from the results folders
(benchmarks/results/x86_64-*/results.json):

    python benchmarks/runs_table.py        # paste its output under PERFORMANCE.md's table
    python benchmarks/runs_table.py --plot # benchmarks/results/runs.png: the newest run of
                                           # each class on each CPU, row by row

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


def run_ratios(folder: Path) -> dict:
    """One results folder: its class, host CPU (LLVM name), date, how the class ran there,
    and per row (threads, shape, mask), in the run's order, mhagen / the fastest peer
    (`ratios`) and mhagen / the faster ONNX Runtime (`to_ort`)."""
    data = json.loads((folder / "results.json").read_text())
    cls, host = folder.name.split("_on_")
    llvm = next(name for name in CPUS if host.startswith(name))
    avx2_only_host = llvm == "znver3"
    via_preset = "v256" in cls and not avx2_only_host
    peers = AVX2_PEERS if via_preset else AVX2_PEERS + ORT
    groups = {}
    for r in data["rows"]:
        groups.setdefault((r["threads"], r["shape"], r["mask"]), {})[r["impl"]] = r
    return {"folder": folder.name, "cls": cls, "cpu": llvm, "date": data["meta"]["date"],
            "data": data,
            "via_preset": via_preset,
            "how": ("AVX2 on real AVX2-only hardware" if avx2_only_host else
                    "AVX2 through `x86-avx2`" if via_preset else "AVX-512"),
            "ratios": {k: round(g["mhagen"]["median_ms"] / _fastest(g, peers), 2)
                       for k, g in groups.items()},
            "to_ort": {k: round(g["mhagen"]["median_ms"] / _fastest(g, ORT), 2)
                       for k, g in groups.items()}}


def run_line(folder: Path) -> tuple:
    """(date, table line) of one results folder."""
    run = run_ratios(folder)
    ratios, to_ort = list(run["ratios"].values()), list(run["to_ort"].values())
    shares = " / ".join(
        "{:.0f}-{:.0f}%".format(100 * min(s.values()), 100 * max(s.values()))
        for s in (run["data"]["summary"][t]["mhagen_peak_share_seq512_nomask"]
                  for t in ("1", "2")))
    line = (f"| [{folder.name}](results/{folder.name}/results.md) "
            f"| {run['date'][:10]} | {CPUS[run['cpu']]}: {run['how']} "
            f"| {'torch, numpy (AVX2)' if run['via_preset'] else 'all'} "
            f"| {sum(x <= 1.0 for x in ratios)} of {len(ratios)} "
            f"| {min(ratios):.2f}-{max(ratios):.2f} | {shares} "
            f"| {sum(x <= 1.0 for x in to_ort)} of {len(to_ort)} "
            f"({min(to_ort):.2f}-{max(to_ort):.2f}) |")
    return run["date"], line


def table(results: Path = RESULTS) -> str:
    lines = sorted((run_line(f) for f in results.glob("x86_64-*") if f.is_dir()),
                   reverse=True)
    return "\n".join([HEADER] + [line for _, line in lines])


def latest_runs(results: Path = RESULTS) -> list:
    """The newest run of each (class, host CPU), as run_ratios gives them: AVX-512 class
    first, then by CPU."""
    newest = {}
    for f in results.glob("x86_64-*"):
        if f.is_dir():
            run = run_ratios(f)
            key = (run["cls"], run["cpu"])
            if key not in newest or run["date"] > newest[key]["date"]:
                newest[key] = run
    return [newest[k] for k in sorted(newest, key=lambda k: ("v256" in k[0], k[1]))]


def plotted(runs) -> str:
    """What plot writes into the PNG's Description: the results folders it drew."""
    return "runs: " + " ".join(sorted(r["folder"] for r in runs))


def plot(path: Path, results: Path = RESULTS) -> Path:
    """A PNG of latest_runs: per class (AVX-512 above, AVX2 below) mhagen / the fastest peer
    on every row of each CPU's newest run, under 1.0 where mhagen is faster."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = latest_runs(results)
    fig, axes = plt.subplots(2, 1, figsize=(13, 7.5), sharex=True)
    for ax, avx2 in zip(axes, (False, True)):
        shown = [r for r in runs if ("v256" in r["cls"]) == avx2]
        keys = list(shown[0]["ratios"])
        for i, run in enumerate(shown):
            xs = [keys.index(k) + (i - (len(shown) - 1) / 2) * 0.12 for k in run["ratios"]]
            ax.plot(xs, list(run["ratios"].values()), "o", markersize=6,
                    label=f"{CPUS[run['cpu']]} ({run['how'].replace('`', '')}), "
                          f"{run['date'][:10]}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        for i in range(1, len(keys)):   # one shape's rows between dotted lines
            if keys[i][1] != keys[i - 1][1]:
                ax.axvline(i - 0.5, color="grey", linewidth=0.6, linestyle=":")
        ax.set_ylabel("mhagen / fastest peer\n(below 1: mhagen faster)")
        ax.set_title("AVX2 class (peers held to AVX2 on AVX-512 hosts)" if avx2 else
                     "AVX-512 class", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(axis="y", alpha=0.3)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{shape}\n{mask}, {t}T" for t, shape, mask in keys],
                           rotation=60, fontsize=7)
    fig.suptitle("bench_mha.py: the newest run of each x86 class on each CPU (medians; "
                 "1T / 2T: 1 / 2 threads)", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    # the folders drawn, in the PNG's text (a test compares them with the results folders)
    fig.savefig(path, dpi=80, metadata={"Description": plotted(runs)})
    plt.close(fig)
    return path


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"]:   # python benchmarks/runs_table.py --plot [PNG]
        print(plot(sys.argv[2] if len(sys.argv) > 2 else RESULTS / "runs.png"))
    else:
        sys.stdout.write(table() + "\n")
