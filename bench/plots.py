#!/usr/bin/python3
"""Regenerate the plots of docs/BENCHMARKS.md from the CSV summaries under docs/results/.

    /usr/bin/python3 bench/plots.py        (Debian's python3-matplotlib; no other input)

Writes docs/img/*.png, small (about 100 dpi, a few tens of KiB each). Every figure is drawn
next to the reference measured in the same run, as the CSVs record it; nothing is measured
here. A CSV's lines starting with '#' say the command, the machine and the commit.
"""
import csv
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "docs", "results")
IMG = os.path.join(ROOT, "docs", "img")


def rows(rel):
    with open(os.path.join(RES, rel), newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def save(fig, name):
    path = os.path.join(IMG, name)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"{os.path.relpath(path, ROOT)}: {os.path.getsize(path) // 1024} KiB")


def bars(ax, labels, series, width=0.38):
    """series: [(name, values)], drawn side by side per label."""
    n = len(series)
    for i, (name, vals) in enumerate(series):
        xs = [x + (i - (n - 1) / 2) * width for x in range(len(labels))]
        ax.bar(xs, vals, width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)


def host_throughput():
    """Host path (ipc): kvferry against one contiguous memcpy of the same bytes, per run."""
    epyc = rows("epyc/e2e_host.csv")
    xeon = [r for r in rows("xeon/e2e.csv") if r["kvferry_gib_s"]]
    labels = [f"EPYC\nrun {r['run']}" for r in epyc] + [f"Xeon\nrun {r['run']}" for r in xeon]
    k = [float(r["kvferry_gib_s"]) for r in epyc + xeon]
    m = [float(r["memcpy_gib_s"]) for r in epyc + xeon]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    bars(ax, labels, [("kvferry", k), ("memcpy, same bytes, same run", m)])
    for x, (a, b) in enumerate(zip(k, m)):
        ax.text(x, max(a, b) + 0.2, f"{a / b:.2f}x", ha="center", fontsize=8)
    ax.set_ylabel("GiB/s")
    ax.set_title("Host path throughput (e2e_bench.sh; EPYC: 2 MiB pages, Xeon: 4 KiB)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    save(fig, "host_throughput.png")


def tcp_vs_iperf3():
    """tcp on loopback against iperf3 -P 2 -l <block>, median of the runs, per block size."""
    data = rows("epyc/e2e_tcp.csv")
    blocks = sorted({int(r["block_kib"]) for r in data})
    labels = [f"{b} KiB" for b in blocks]

    def med(block, layout, col):
        return statistics.median(float(r[col]) for r in data
                                 if int(r["block_kib"]) == block and r["layout"] == layout)

    series = [("kvferry, scattered", [med(b, "scattered", "kvferry_gb_s") for b in blocks]),
              ("kvferry, contiguous", [med(b, "contiguous", "kvferry_gb_s") for b in blocks]),
              ("iperf3 -P 2", [med(b, "scattered", "iperf3_gb_s") for b in blocks])]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars(ax, labels, series, width=0.27)
    ax.set_ylabel("GB/s (median of 5 runs)")
    ax.set_title("TCP on loopback against iperf3, AMD EPYC 2-vCPU VM", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    save(fig, "tcp_vs_iperf3.png")


def gpu_copy():
    """The copy kernel's later layers and a 32-layer step against one bulk cudaMemcpyAsync."""
    data = rows("h200/gpu_copy.csv")
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for block in sorted({int(r["block_kib"]) for r in data}):
        rs = [r for r in data if int(r["block_kib"]) == block]
        xs = [float(r["batch_mib"]) for r in rs]
        ax.plot(xs, [float(r["step_x_bulk"]) for r in rs], marker="o", label=f"{block} KiB blocks")
    ax.axhline(0.85, color="grey", linestyle="--", linewidth=1)
    ax.text(1.0, 0.86, "target 0.85 (batches >= 64 MiB)", fontsize=7, color="grey")
    ax.set_xscale("log", base=4)
    ax.set_xticks([1, 4, 16, 64, 256])
    ax.set_xticklabels(["1", "4", "16", "64", "256"])
    ax.set_xlabel("batch (MiB per layer)")
    ax.set_ylabel("kernel / bulk copy, over a step")
    ax.set_ylim(0.5, 1.0)
    ax.set_title("GPU copy kernel against one bulk cudaMemcpyAsync, H200", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    save(fig, "gpu_copy_vs_bulk.png")


def latency():
    """Transfer tail and layer-done -> copy start, p50 and p99, per machine."""
    epyc = rows("epyc/e2e_host.csv")
    gpu = rows("h200/gpu_tail.csv")
    lat = [r for r in rows("h200/gpu_latency.csv") if "no MPS" not in r["row"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = [f"EPYC {r['run']}" for r in epyc] + [r["executor"].replace(" ", "\n", 1) for r in gpu]
    p50 = [float(r["tail_one_p50_us"]) for r in epyc] + [float(r["tail_p50_us"]) for r in gpu]
    p99 = [float(r["tail_one_p99_in_time_us"]) for r in epyc] + [float(r["tail_p99_us"]) for r in gpu]
    bars(a1, labels, [("p50", p50), ("p99", p99)])
    a1.set_yscale("log")
    a1.set_ylabel("us")
    a1.tick_params(axis="x", labelsize=6)
    a1.set_title("Transfer tail, tasks in time (EPYC host path; H200 GPU)", fontsize=8)
    a1.legend(fontsize=7)
    labels = [f"EPYC {r['run']}" for r in epyc] + [("H200 MPS" if "MPS" in r["row"] else "H200 ctx") + "\n" + r["engine"] for r in lat]
    p50 = [float(r["copy_start_p50_us"]) for r in epyc] + [float(r["start_p50_us"]) for r in lat]
    p99 = [float(r["copy_start_p99_us"]) for r in epyc] + [None] * len(lat)
    bars(a2, labels, [("p50", p50), ("p99 (host path)", [v or 0 for v in p99])])
    a2.axhline(20, color="grey", linestyle="--", linewidth=1)
    a2.axhline(200, color="grey", linestyle=":", linewidth=1)
    a2.set_yscale("log")
    a2.tick_params(axis="x", labelsize=5)
    a2.set_title("Layer-done -> copy start (targets: p50 20 us, p99 200 us)", fontsize=8)
    a2.legend(fontsize=7)
    save(fig, "latency_p50_p99.png")


def ring():
    """kvf-bench-ring: records/s against the pipe, and the wake round trip against the pipe's."""
    data = rows("xeon/ring.csv")
    thr = [r for r in data if r["kind"] == "throughput"]
    wake = [r for r in data if r["kind"] == "wake" and r["size_bytes"] == "64"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.0))
    for size, name in (("64", "64 B"), ("4096", "4 KiB")):
        rs = [r for r in thr if r["size_bytes"] == size]
        a1.plot([r["mechanism"] for r in rs], [float(r["x_pipe"]) for r in rs], marker="o", label=name)
    a1.axhline(20, color="grey", linestyle="--", linewidth=1)
    a1.set_yscale("log")
    a1.set_ylabel("records/s / the pipe's")
    a1.tick_params(axis="x", labelsize=7, rotation=30)
    a1.set_title("Throughput (target: ring >= 20x pipe at 64 B)", fontsize=8)
    a1.legend(fontsize=7)
    names = [r["mechanism"] for r in wake]
    bars(a2, names, [("p50", [float(r["p50_us"]) for r in wake]),
                     ("p99", [float(r["p99_us"]) for r in wake])])
    a2.set_ylabel("round trip, us (64 B)")
    a2.tick_params(axis="x", labelsize=7, rotation=30)
    a2.set_title("Wake round trip, receiver asleep", fontsize=8)
    a2.legend(fontsize=7)
    save(fig, "ring_vs_pipe.png")


def main():
    os.makedirs(IMG, exist_ok=True)
    for plot in (host_throughput, tcp_vs_iperf3, gpu_copy, latency, ring):
        plot()
    return 0


if __name__ == "__main__":
    sys.exit(main())
