"""Print the ablation results of scripts/research/ablations_smollm2.sh as a Markdown table.

Usage: python scripts/research/ablation_table.py work_data/ablations
Reads each run's bench.json (EAGLE-3 chain on MT-bench) and trainer_state.json (last logged TTT accuracies).
"""

import json
import os
import sys

from eagle3_hf.bench.cards import format_rates

RUNS = {  # folder: (what it tests, description)
    "fused_ttt7_all": ("baseline", "fused taps, TTT 7, all data"),
    "fused_ttt1_all": ("(a)", "fused taps, TTT 1 (no training-time test), all data"),
    "top_ttt7_all": ("(c)", "top layer only, TTT 7, all data"),
    "fused_ttt7_128": ("(b)", "fused taps, TTT 7, 128 conversations"),
    "fused_ttt7_512": ("(b)", "fused taps, TTT 7, 512 conversations"),
}


def main(root: str) -> None:
    print("| run | draft | chain tau | acceptance by depth 1-6 (MT-bench) | train acc, TTT steps 0-6 |")
    print("|---|---|---|---|---|")
    for name, (claim, description) in RUNS.items():
        bench_path = os.path.join(root, name, "bench.json")
        if not os.path.exists(bench_path):
            print(f"| {claim} | {description} | (not run) | | |")
            continue
        with open(bench_path) as f:
            bench = json.load(f)
        accs = ""
        state_path = os.path.join(root, name, "trainer_state.json")
        if os.path.exists(state_path):
            with open(state_path) as f:
                logs = [log for log in json.load(f)["log_history"] if "acc_0" in log]
            if logs:
                last = logs[-1]
                accs = " / ".join(f"{last[k]:.2f}" for k in sorted(k for k in last if k.startswith("acc_")))
        depth = format_rates(bench["acceptance_by_depth"], " / ")
        if "acceptance_by_depth_cycles" in bench:
            depth += " (cycles: " + " / ".join(str(n) for n in bench["acceptance_by_depth_cycles"]) + ")"
        print(f"| {claim} | {description} | {bench['tau_chain']:.2f} | {depth} | {accs} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/research/ablation_table.py ABLATIONS_FOLDER")
    main(sys.argv[1])
