"""Helpers shared by the tests/bench suite (a unique module name, so the
suite's own conftest.py never clashes with tests/conftest.py)."""

from PIL import Image


class WordTokenizer:
    """Tiny HF-like tokenizer: words ``w0``..``w999`` map to ids 0..999 (0-2 special)."""

    all_special_ids = [0, 1, 2]

    def __len__(self) -> int:
        return 1000

    def encode(self, text, add_special_tokens=False):
        out = []
        for w in text.split():
            if w.startswith("w") and w[1:].isdigit() and int(w[1:]) < 1000:
                out.append(int(w[1:]))
            else:
                out.append(3 + (sum(map(ord, w)) % 997))
        return out

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids if not (skip_special_tokens and i in self.all_special_ids))


def run_cli(argv, tokenizer=None):
    """Parse ``argv`` with the ``pagedllm`` parser and run it with an injected tokenizer.

    Returns the exit code. ``tokenizer=None`` means no tokenizer (fallback ids).
    """
    from pagedllm.benchmarks.profile_summary import summarize_main
    from pagedllm.benchmarks.serve import serve_main
    from pagedllm.benchmarks.sweep import sweep_main
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(argv)
    if args.command == "profile":
        return summarize_main(args)
    fn = serve_main if args.bench_command == "serve" else sweep_main
    return fn(args, tokenizer=tokenizer)


SUMMARY_KEYS = {
    "duration_s", "num_requests", "completed", "failed", "error_rate", "total_retries", "requests_retried",
    "retry_rate", "total_input_tokens", "total_output_tokens", "request_throughput", "input_token_throughput",
    "output_token_throughput", "total_token_throughput", "goodput_slos_ms", "goodput", "good_requests",
    "goodput_fraction", "client_prefill_share", "client_decode_share", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
    "client_wait_ms", "errors", "peak_in_flight", "num_sessions", "num_warmups",
}
STAT_KEYS = {"count", "mean", "median", "std", "min", "max", "p50", "p90", "p99"}
SERVER_KEYS = {
    "available", "queue_mean_ms", "prefill_mean_ms", "decode_mean_ms", "queue_time_share", "prefill_time_share",
    "decode_time_share", "num_preemptions", "prefix_cache_hit_rate", "prefix_cache_queries", "prefix_cache_hits",
    "prompt_tokens", "generation_tokens", "requests_succeeded", "ttft_mean_ms", "e2e_mean_ms",
    "finished_reasons", "num_requests_running_after", "kv_cache_usage_perc_after",
}
REQUEST_KEYS = {
    "request_id", "session_id", "turn", "success", "error", "http_status", "retries", "prompt_tokens",
    "output_tokens", "output_tokens_source", "scheduled_s", "start_s", "first_token_s", "end_s", "ttft_ms",
    "tpot_ms", "e2e_ms", "itl_ms",
}
TOP_KEYS = {"schema_version", "tool", "label", "date", "start_unix_s", "config", "dataset", "tokenizer_exact",
            "summary", "server_metrics", "requests"}


def check_png(path, min_w=400, min_h=200):
    with Image.open(path) as im:
        assert im.format == "PNG"
        w, h = im.size
        assert w >= min_w and h >= min_h
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 10  # more than background + one line colour
        # a non-trivial share of the image is drawn (not just white)
        nonwhite = sum(n for n, c in colors if c != (255, 255, 255))
        assert nonwhite > 0.02 * w * h
