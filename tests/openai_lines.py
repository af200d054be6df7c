"""OpenAI Batch request lines for the tests: a chat or a completions line, a file of them, and what a job made
of them."""

from __future__ import annotations

import gzip
import json

from overnight.pipeline.tools.inspection import open_results

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(cid, content="Say hi.", **body):
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body}}


def completion(cid, prompt="Once upon a time", **body):
    return {"custom_id": cid, "method": "POST", "url": COMPLETIONS, "body": {"model": "x", "prompt": prompt, **body}}


def write_lines(path, lines) -> str:
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def rows_of(src) -> list[dict]:
    return [r for sb in src.batches() for r in sb.batch.to_pylist()]


def results(out) -> dict:
    con, _ = open_results(str(out))
    cur = con.execute("select * from results")
    names = [d[0] for d in cur.description]
    return {r["id"] if r["id"] is not None else r["error"].split(":")[0]: r
            for r in (dict(zip(names, x)) for x in cur.fetchall())}
