"""`overnight models prepare`: shards of an array starting together on one machine convert the embedded model
once; the others wait for that conversion, then load the folder it wrote."""

import json
import os
import threading
import time

from overnight.pipeline.tools import models


def test_concurrent_prepares_convert_once_and_none_removes_the_others_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERNIGHT_CACHE", str(tmp_path))
    calls = []

    def slow_convert(name, alias, target, echo):
        calls.append(name)
        time.sleep(0.3)   # as a conversion takes a while: the others would start their own meanwhile
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, models._MARKER), "w") as f:
            json.dump({"alias": name}, f)
        return target

    monkeypatch.setattr(models, "_convert", slow_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.prepare("smollm2-135m"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["smollm2-135m"] and len(set(got)) == 1 and len(got) == 3
    assert models.is_prepared(models.ALIASES["smollm2-135m"])
