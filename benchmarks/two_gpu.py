"""Two GPUs in one device call: P/D across GPUs against NORMAL on one GPU, the KV hand-off over
each transport, a NORMAL DP-2 group over NCCL, and the GPU suite's bf16 correctness check.

    python benchmarks/two_gpu.py [--out DIR] [--budget-s 480] [--dry-run] [--parts normal,correct,pd,dp]

Workers, one process each (``two_gpu_workers.py``), in three phases:
  1. GPU 0: NORMAL engine (the correctness prompts one at a time, then the workload), then the
     bf16 correctness check on the 1B shape; GPU 1: the same check on the 8B shape.
  2. PE on GPU 0, CE on GPU 1 (both see both GPUs): per transport, cuda_ipc, nccl, then tcp: connector
     GB/s, the correctness prompts one at a time, the workload (TTFT and TPOT timed by the CE).
  3. NORMAL DP-2 over NCCL, one rank per GPU: each rank's prompts alone, then in the group.
Writes two_gpu.log (this output), workers.log and two_gpu.json to ``--out`` and prints one table
last. ``--dry-run``: the same on CPU with a small model (shared memory for cuda_ipc, gloo for the DP
group; no correctness check), to test the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import two_gpu_workers as workers  # noqa: E402

SAFETY = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RESULTS: dict = {}


def log(msg: str) -> None:
    print(msg, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    """Starts workers with their own logs, waits with deadlines, collects their JSON."""

    def __init__(self, args):
        self.args, self.start = args, time.monotonic()
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def spawn(self, name: str, *extra: str, visible: str | None = None) -> tuple[str, subprocess.Popen]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **SAFETY)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--part",
            name,
            "--json",
            str(self.work / f"{name}.json"),
            *extra,
        ]
        if self.args.dry_run:
            cmd.append("--dry-run")
        logf = open(self.work / f"{name}.log", "w")  # noqa: SIM115 - closed when the worker is reaped
        log(f"[{time.monotonic() - self.start:6.1f} s] start {name}")
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        proc.logf = logf
        return name, proc

    def wait(self, jobs, limit_s: float) -> None:
        limit_s *= 20 if self.args.dry_run else 1  # two loaded CPU cores, not two GPUs
        end = time.monotonic() + max(0.0, min(limit_s, self.left()))
        for name, proc in jobs:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"  {name}: out of time, stopped")
                proc.kill()  # only our own worker, by its pid
                proc.wait()
                RESULTS.setdefault("timeouts", []).append(name)
            proc.logf.close()
            log(f"[{time.monotonic() - self.start:6.1f} s] {name} exited ({proc.returncode})")
            path = self.work / f"{name}.json"
            RESULTS[name] = json.loads(path.read_text()) if path.exists() else {"error": f"exit {proc.returncode}"}
            with open(self.out / "workers.log", "a") as all_logs:
                all_logs.write(f"\n===== {name} (exit {proc.returncode}) =====\n")
                all_logs.write((self.work / f"{name}.log").read_text(errors="replace"))
            (self.out / "two_gpu.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/two_gpu"))
    parser.add_argument("--work", default="/tmp/two_gpu")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--parts", default="normal,correct,pd,dp", help="comma list of: normal, correct, pd, dp")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    run = Runner(args)
    log(f"two_gpu {time.strftime('%Y-%m-%d %H:%M')} dry_run={args.dry_run}")
    if not args.dry_run:
        log(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout)
    # 1. NORMAL on GPU 0 and the correctness checks (GPU 1: 8B; GPU 0 after NORMAL: 1B)
    correct = "correct" in parts and not args.dry_run
    big = run.spawn("correct8b", "--preset", "llama-3.1-8b", visible="1") if correct else None
    if "normal" in parts:
        run.wait([run.spawn("normal")], 150)
    if correct:
        run.wait([run.spawn("correct1b", "--preset", "llama-3.2-1b", visible="0"), big], 200)
    # 2. P/D across the GPUs over cuda_ipc, nccl and tcp; 3. DP-2
    if "pd" in parts:
        port = str(free_port())
        run.wait(
            [
                run.spawn("ce", "--port", port, "--kinds", "cuda_ipc,nccl,tcp"),
                run.spawn("pe", "--port", port, "--kinds", "cuda_ipc,nccl,tcp"),
            ],
            240,
        )
    if "dp" in parts:
        from pdinfer.distributed.dp_group import host_store

        store = host_store("127.0.0.1")
        run.wait(
            [
                run.spawn("dp0", "--rank", "0", "--port", str(store.port)),
                run.spawn("dp1", "--rank", "1", "--port", str(store.port)),
            ],
            90,
        )
    log(f"\ntotal {time.monotonic() - run.start:.0f} s\n")
    log(table(RESULTS))


# --- the table ---------------------------------------------------------------------------------------
def table(r: dict) -> str:
    rows = [("what", "result", "reference / check")]
    normal = r.get("normal", {})
    pd = r.get("ce", {})
    if "workload" in normal:
        rows.append(("NORMAL, 1 GPU: workload", _workload(normal["workload"]), _blocks(normal.get("free_blocks"))))
    for kind, res in pd.items():
        if "workload" not in res:
            rows.append((f"P/D {kind}", "ERROR", (res.get("error") or "").strip().splitlines()[-1:]))
            continue
        same = sum(res["correct"].get(k) == v for k, v in normal.get("correct", {}).items())
        work_same = sum(res["workload_tokens"].get(k) == v for k, v in normal.get("workload_tokens", {}).items())
        rows.append(
            (
                f"P/D {kind}, PE GPU0 + CE GPU1: workload",
                _workload(res["workload"]),
                _speedup(res["workload"], normal.get("workload")),
            )
        )
        rows.append(
            (
                f"P/D {kind}: output = NORMAL (greedy, one at a time)",
                f"{same}/{len(normal.get('correct', {}))} equal",
                f"workload (batched): {work_same}/{len(normal.get('workload_tokens', {}))} equal",
            )
        )
        pe = res.get("pe", {})
        rows.append(
            (
                f"P/D {kind}: free blocks back, hand-offs",
                f"PE {_blocks(pe.get('free_blocks'))}, CE {_blocks(res.get('ce_free_blocks'))}",
                f"{pe.get('count')} ok, {pe.get('failed')} failed, "
                f"{pe.get('bytes', 0) / max(pe.get('seconds', 0), 1e-9) / 1e9:.1f} GB/s push->ack in the engines",
            )
        )
        for m in res["micro"].get("sizes", {}).values():
            rows.append(
                (
                    f"hand-off {kind}, {m['MiB']:.0f} MiB pushes (stage, send, land, check, ack)",
                    f"{m['GBps']:.1f} GB/s",
                    f"{m['ms_per_push']:.1f} ms/push, refused {len(res['micro'].get('refused', []))}",
                )
            )
    dp = [r[k] for k in ("dp0", "dp1") if "rank" in r.get(k, {})]
    if dp:
        per_step = max(d["allreduce_us_per_step"] for d in dp)
        rows.append(
            (
                "DP-2 over NCCL: time in the vote per step (waiting for the other rank included)",
                f"{per_step:.0f} us/step",
                f"{max(d['allreduce_us_per_call'] for d in dp):.0f} us/call, "
                f"{dp[0]['steps']} steps, {max(d['dp2_s'] for d in dp) * 1e3 / max(1, dp[0]['steps']):.1f} ms/step wall",
            )
        )
        if all("vote_alone_us" in d for d in dp):
            rows.append(
                (
                    "DP-2 over NCCL: one vote alone (200 back to back)",
                    f"{max(d['vote_alone_us'] for d in dp):.0f} us/call",
                    "the all-reduce and its host sync",
                )
            )
        rows.append(
            (
                "DP-2 output = DP-1 (each rank's prompts alone)",
                " + ".join(f"{d['equal']}/{d['of']}" for d in dp),
                f"DP-2 {max(d['dp2_s'] for d in dp):.2f} s vs DP-1 {max(d['dp1_s'] for d in dp):.2f} s; "
                f"blocks {', '.join(_blocks(d['free_blocks']) for d in dp)}",
            )
        )
    for key in ("correct1b", "correct8b"):
        for row in r.get(key, {}).get("rows", []):
            rows.append((row[0], row[1], f"{row[2]} {row[3]}".strip()))
        if r.get(key, {}).get("fig", {}).get("error"):
            rows.append((key, "ERROR (see workers.log)", ""))
    for name in r.get("timeouts", []):
        rows.append((name, "stopped: out of time", ""))
    widths = [max(len(str(row[i])) for row in rows) for i in range(3)]
    return "\n".join("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows)


def _workload(w: dict) -> str:
    return (
        f"TTFT {w['ttft_mean_s']:.2f} s (p50 {w['ttft_p50_s']:.2f}), TPOT {w['tpot_mean_ms']:.1f} ms, "
        f"{w['out_tok_s']:.0f} out tok/s" + (f", {w['errors']} errors" if w["errors"] else "")
    )


def _speedup(w: dict, base: dict | None) -> str:
    if not base:
        return ""
    return (
        f"vs NORMAL: TTFT x{w['ttft_mean_s'] / base['ttft_mean_s']:.2f}, TPOT x"
        f"{w['tpot_mean_ms'] / base['tpot_mean_ms']:.2f}, tok/s x{w['out_tok_s'] / base['out_tok_s']:.2f}"
    )


def _blocks(pair) -> str:
    if not pair:
        return "?"
    return f"{pair[0]}/{pair[1]} free" + ("" if pair[0] == pair[1] else " LEAK")


# --- worker entry ------------------------------------------------------------------------------------
def worker_main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--part", "--json", "--preset", "--kinds"):
        parser.add_argument(flag)
    parser.add_argument("--port", type=int)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--dry-run", action="store_true")
    a = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup, out = workers.Setup(a.dry_run), Path(a.json)
    if a.part == "normal":
        workers.part_normal(setup, out)
    elif a.part.startswith("correct"):
        workers.part_correct(setup, out, a.preset)
    elif a.part.startswith("pe"):
        workers.part_pe(setup, out, a.port, a.kinds.split(","))
    elif a.part.startswith("ce"):
        workers.part_ce(setup, out, a.port, a.kinds.split(","))
    elif a.part.startswith("dp"):
        workers.part_dp(setup, out, a.rank, a.port)


if __name__ == "__main__":
    worker_main() if "--part" in sys.argv else main()
