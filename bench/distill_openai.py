"""Client throughput of the distill `openai` backend against a local `transformers serve`.

For 1, 4 and 16 requests in flight (by default) it sends the same prompts through
`distill.openai_backend.generate_openai`, writing real records with the stage's RecordWriter, and
prints requests/s, response tokens/s, the client process's CPU share of the wall time, its CPU
milliseconds per request sent and per record written, and the share of wall time spent in polydraft's own code (self time of functions under `distill/` and `pipelines/`,
measured in a second, profiled pass; the rest is the openai client, the event loop, and waiting for
the server).

    python bench/distill_openai.py                       # tiny random model built here, 32 prompts
    python bench/distill_openai.py --model DIR --prompts 200 --max-new-tokens 64 --in-flight 1 4 16
    python bench/distill_openai.py --faults 0.4 --in-flight 64 --prompts 512   # no model: two servers
        # (tests/fault_server.py, own processes) that fail 40% of requests in every way the tests inject
    python bench/distill_openai.py --faults 0.4 --in-flight 64 --prompts 512 --token-latency 0.005
        # the same servers answering a 200 only after 5 ms per token of max_new_tokens, as a GPU server
        # decoding would (its share of wall time is CPU per request x requests/s: with servers that
        # answer at once it only shows how many requests/s the client can drive)

Run it on a quiet machine: the server and the client share the CPU cores.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

PROJECT_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_ROOT))

from polydraft.data.prompts import VICUNA_CHAT_TEMPLATE, build_prompt, translation_messages  # noqa: E402
from polydraft.distill.openai_backend import ServerSettings, generate_openai  # noqa: E402
from polydraft.distill.requests import PromptItem, Request  # noqa: E402
from polydraft.distill.store import RecordStore, RecordWriter  # noqa: E402

OWN_CODE = (str(PROJECT_ROOT / "distill"), str(PROJECT_ROOT / "pipelines"))


def build_tiny_model(folder: Path) -> None:
    """A random 4-layer Llama with a tokenizer trained on the offline corpus (as in the tests)."""
    from polydraft.data.offline import offline_texts
    from polydraft.models.tiny import build_llama, train_tokenizer

    tokenizer = train_tokenizer(
        [r["text"] for r in offline_texts(["de", "fr"], 400, seed=0)],
        vocab_size=512,
        chat_template=VICUNA_CHAT_TEMPLATE,
    )
    model = build_llama(len(tokenizer), 64, 4, 4, 128, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def serve(model: Path, workdir: Path, continuous_batching: bool) -> tuple[subprocess.Popen, str]:
    """Start `transformers serve` on a free port (sampling on: it only samples when the model's
    generation_config says do_sample) and wait until /health answers."""
    served = workdir / "model"
    shutil.copytree(model, served)
    config_path = served / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config_path.write_text(json.dumps({**config, "do_sample": True}))
    (workdir / "hf_home" / "hub").mkdir(parents=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cli = Path(sys.executable).with_name("transformers")
    env = {**os.environ, "HF_HOME": str(workdir / "hf_home"), "HF_HUB_OFFLINE": "1"}
    command = [str(cli), "serve", str(served), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    if continuous_batching:
        command.append("--continuous-batching")
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.25)
    process.kill()
    raise RuntimeError("transformers serve did not start")


def fault_servers(
    count: int, fail_rate: float, hang: float, token_latency: float, request_latency: float
) -> tuple[list[subprocess.Popen], list[str]]:
    """`count` fault-injecting servers (tests/fault_server.py), each a process of its own."""
    processes, urls = [], []
    for seed in range(count):
        command = [sys.executable, "-m", "tests.fault_server", str(fail_rate), str(hang), str(seed),
                   str(token_latency), str(request_latency)]  # fmt: skip
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
        processes.append(process)
        urls.append(process.stdout.readline().strip())
    return processes, urls


def requests_for(count: int) -> list[Request]:
    from polydraft.data.offline import offline_pairs

    rows = offline_pairs("de-en", "train", count, (1, 2), 0.1, 0)
    requests = []
    for index, row in enumerate(rows):
        messages = translation_messages("de-en", row["source"])
        item = PromptItem(f"bench:{index}", "bench", "de-en", messages, build_prompt(messages, "vicuna"))
        requests.append(Request(item, 1.0, [0]))
    return requests


def one_pass(requests: list[Request], settings: ServerSettings, max_new_tokens: int, workdir: Path) -> dict:
    store = RecordStore(workdir, 0, 100_000)
    meta = {"backend": "openai", "model": settings.model, "model_revision": ""}
    writer = RecordWriter(store, meta, 0, 32, set(), SimpleNamespace(update=lambda n: None), lambda m: None)
    wall, cpu = time.perf_counter(), time.process_time()
    stats = generate_openai(requests, settings, top_p=1.0, max_new_tokens=max_new_tokens, stop=[], stop_token_ids=[], seed=0,
                            emit=writer.emit, fail=writer.fail)  # fmt: skip
    writer.flush()
    store.close()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "wall": wall,
        "cpu": cpu,
        "stats": stats,
        "tokens": writer.response_tokens,
        "records": writer.written,
    }


def own_code_seconds(profile: cProfile.Profile) -> float:
    """Self time of every function defined in polydraft's own files."""
    stats = pstats.Stats(profile)
    return sum(row[2] for (path, _, _), row in stats.stats.items() if path.startswith(OWN_CODE))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="a local HF model folder (default: a tiny random Llama)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--continuous-batching", action="store_true", help="start the server with it")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--faults", type=float, metavar="RATE",
                        help="instead of a model, two fault-injecting servers failing this share of requests")  # fmt: skip
    parser.add_argument("--token-latency", type=float, default=0.0, metavar="S",
                        help="with --faults: the servers answer a 200 after S seconds per token of max_new_tokens")  # fmt: skip
    parser.add_argument("--request-latency", type=float, default=0.0, metavar="S",
                        help="with --faults: and after S seconds more per request")  # fmt: skip
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="polydraft-bench-"))
    processes = []
    try:
        model = args.model
        if args.faults is not None:  # hangs 3x the timeout, which is 1 s more than twice a generation
            generation = args.request_latency + args.token_latency * args.max_new_tokens
            timeout = 1.0 + 2 * generation
            processes, base_urls = fault_servers(
                2, args.faults, 3 * timeout, args.token_latency, args.request_latency
            )
            timing = (timeout, 12, 0.05, 1.0)
        else:
            if model is None:
                model = workdir / "tiny"
                build_tiny_model(model)
            process, base_url = serve(model, workdir, args.continuous_batching)
            processes, base_urls, timing = [process], [base_url], (600.0, 3, 0.5, 5.0)
        requests = requests_for(args.prompts)
        results = []
        for in_flight in args.in_flight:
            settings = ServerSettings(base_urls, str(workdir / "model"), "completions", "EMPTY", in_flight,
                                      *timing, 64, False)  # fmt: skip
            one_pass(requests[:2], settings, 2, workdir / f"warm{in_flight}")
            plain = one_pass(requests, settings, args.max_new_tokens, workdir / f"run{in_flight}")
            profile = cProfile.Profile()
            profile.enable()
            profiled = one_pass(requests, settings, args.max_new_tokens, workdir / f"prof{in_flight}")
            profile.disable()
            results.append(
                {
                    "in_flight": in_flight,
                    "requests": plain["stats"]["requests"],
                    "records": plain["records"],
                    "wall_s": round(plain["wall"], 3),
                    "requests_per_s": round(plain["stats"]["requests"] / plain["wall"], 2),
                    "tokens_per_s": round(plain["tokens"] / plain["wall"], 1),
                    "client_cpu_share": round(plain["cpu"] / plain["wall"], 3),
                    "cpu_ms_per_request": round(1e3 * plain["cpu"] / plain["stats"]["requests"], 3),
                    "cpu_ms_per_record": round(1e3 * plain["cpu"] / max(1, plain["records"]), 3),
                    "own_code_share": round(own_code_seconds(profile) / profiled["wall"], 4),
                    "failed_requests": plain["stats"]["failed_requests"],
                }
            )
        server = "transformers serve" + (" --continuous-batching" if args.continuous_batching else "")
        if args.faults is not None:
            server = f"2 fault-injecting servers failing {args.faults:.0%} of requests"
            if args.token_latency or args.request_latency:
                server += (
                    f", a 200 after {args.request_latency * 1e3:g} ms + {args.token_latency * 1e3:g} ms/token"
                )
        model_name = "no model" if args.faults is not None else args.model or "tiny random Llama"
        print(f"\n{args.prompts} prompts, max_new_tokens {args.max_new_tokens}, {model_name}, {server}")
        print("| in flight | requests/s | tokens/s | wall s | client CPU share | client CPU ms/request | "
              "client CPU ms/record | polydraft code share | failed requests |")  # fmt: skip
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in results:
            print(f"| {r['in_flight']} | {r['requests_per_s']} | {r['tokens_per_s']} | {r['wall_s']} | "
                  f"{r['client_cpu_share']:.1%} | {r['cpu_ms_per_request']:.3f} | {r['cpu_ms_per_record']:.3f} | "
                  f"{r['own_code_share']:.2%} | {r['failed_requests']} |")  # fmt: skip
        if args.json:
            settings = {
                "prompts": args.prompts,
                "max_new_tokens": args.max_new_tokens,
                "model": str(model_name),
                "server": server,
                "token_latency_s": args.token_latency,
                "request_latency_s": args.request_latency,
            }
            args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
