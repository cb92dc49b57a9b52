"""Comparing our run with the official one, round by round, and the table of it (stdlib only)."""

from __future__ import annotations


def rounds_to_reach(n_tokens: int, emitted_per_round: list[int]) -> int:
    """Rounds after which 1 (the prefill's token) + the rounds' emitted tokens reach n_tokens (all
    rounds where they never do)."""
    total = 1
    for i, e in enumerate(emitted_per_round, 1):
        total += e
        if total >= n_tokens:
            return i
    return len(emitted_per_round)


def compare(ours: dict, official: dict) -> dict:
    """Our run (tokens, emitted per round, cut: whether the last round was cut at the limit / EOS)
    against the official one (tokens: input_ids after the prompt, accepted per round)."""
    n = len(ours["tokens"])
    our_acc = [e - 1 for e in ours["emitted"]]
    off_acc = official["accepted"]
    off_emitted = [a + 1 for a in off_acc]
    off_rounds = rounds_to_reach(n, off_emitted)
    first_diff = None
    for i, a in enumerate(our_acc):
        if i >= len(off_acc):
            first_diff = i + 1
            break
        last_cut = ours["cut"] and i == len(our_acc) - 1
        if (a > off_acc[i]) if last_cut else (a != off_acc[i]):
            first_diff = i + 1
            break
    if first_diff is None and len(off_acc) < len(our_acc):
        first_diff = len(off_acc) + 1
    off_tokens = official["tokens"][:n]
    first_token_diff = next(
        (i for i, (a, b) in enumerate(zip(ours["tokens"], off_tokens)) if a != b),
        None if len(off_tokens) == n else len(off_tokens),
    )
    rounds = len(our_acc)
    off_n = min(n, 1 + sum(off_emitted[:off_rounds]))
    return {
        "new_tokens": n,
        "rounds_ours": rounds,
        "rounds_official": off_rounds,
        "tau_ours": (n - 1) / rounds if rounds else float(n),
        "tau_official": (off_n - 1) / off_rounds if off_rounds else float(off_n),
        "identical_outputs": first_token_diff is None,
        "first_token_that_differs": first_token_diff,
        "first_round_that_differs": first_diff,
        "accepted_ours": our_acc,
        "accepted_official": off_acc[:off_rounds],
        "last_round_cut_ours": ours["cut"],
    }


def format_table(rows: list[dict]) -> str:
    head = ["prompt", "tokens", "rounds ours/official", "tau ours/official", "identical", "differs"]
    lines = [head]
    for r in rows:
        c = r["comparison"]
        d = c["first_round_that_differs"]
        lines.append(
            [
                r["id"],
                str(c["new_tokens"]),
                f"{c['rounds_ours']}/{c['rounds_official']}",
                f"{c['tau_ours']:.2f}/{c['tau_official']:.2f}",
                "yes" if c["identical_outputs"] else f"NO (token {c['first_token_that_differs']})",
                "-" if d is None else f"round {d}",
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)
