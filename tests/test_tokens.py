"""The token model of the trained predictor (buckets/tokens.py), without an engine: a model folder whose word
embeddings carry the length, so words never seen in training can still be predicted from their embeddings; the
table equals the ridge it stands for; files; the job's tokenizer; the train command's report."""

import json
import logging

import numpy as np
import pytest

from overnight.buckets.annotate import LengthAnnotator
from overnight.buckets.features import featurize
from overnight.buckets.metrics import kendall_tau
from overnight.buckets.tokens import TokenInputs, TokenTable, fingerprint, mean_embeddings, token_ids
from overnight.buckets.trained import TrainedPredictor

WIDTH = 16
# Words of one length, so that the text's statistics (characters a word) do not tell the long ones apart.
LONG_SEEN, LONG_UNSEEN = [f"w{i:03d}" for i in range(50)], [f"w{i:03d}" for i in range(50, 100)]
PLAIN_SEEN, PLAIN_UNSEEN = [f"w{i:03d}" for i in range(200, 400)], [f"w{i:03d}" for i in range(400, 600)]


def write_model(folder, seed=0, vocab_size=600):
    """A model folder: a word-level tokenizer over w000..w599 (and more with a larger vocab_size) and a safetensors
    file with only the input embeddings; the first 100 words (the long ones) share a direction."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, **{f"w{i:03d}": i + 1 for i in range(vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>").save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(vocab),
                                                    "max_position_embeddings": 2048}))
    rng = np.random.default_rng(seed)
    emb = rng.normal(0, 1, (len(vocab), WIDTH)).astype(np.float32)
    emb[1:101, 0] += 4.0  # w000..w099
    save_file({"model.embed_tokens.weight": torch.from_numpy(emb).to(torch.bfloat16)},
              str(folder / "model.safetensors"))
    return str(folder)


def prompts(n, seed, long_words, plain_words):
    """Prompts of 8-30 words; the share of long words sets the log length (plus noise)."""
    rng = np.random.default_rng(seed)
    texts, actual = [], []
    for _ in range(n):
        k = int(rng.integers(8, 30))
        share = rng.uniform(0, 0.6)
        words = [str(rng.choice(long_words)) if rng.uniform() < share else str(rng.choice(plain_words))
                 for _ in range(k)]
        texts.append(" ".join(words))
        actual.append(max(1.0, round(60 * np.exp(2.5 * share + rng.normal(0, 0.25)))))
    return texts, np.array(actual)


def batch(texts):
    return featurize(texts, [len(t.split()) + 10 for t in texts], [2000] * len(texts))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("emb-model") / "m")


def test_embeddings_predict_words_never_seen_in_training(model, tmp_path):
    """Training rows use half the long words; held-out rows only the other half. The word model cannot know
    them; the model's embeddings place them with the long words it saw. The average ranks the held-out rows far
    better, is calibrated on rows like the training ones, and survives a round trip through a file."""
    inputs = TokenInputs.of_model(model)
    tr_texts, tr_y = prompts(300, 1, LONG_SEEN, PLAIN_SEEN)
    te_texts, te_y = prompts(200, 2, LONG_UNSEEN, PLAIN_UNSEEN)
    words, _ = TrainedPredictor.fit(batch(tr_texts), tr_y)
    both, report = TrainedPredictor.fit(batch(tr_texts), tr_y, tokens=inputs)
    assert report.tokens["num_rows"] == 300 and report.tokens["tokens_cv_tau"] > 0.4
    assert both.name == "trained, with the model's token embeddings" and words.name == "trained"
    tau_words = kendall_tau(words.predict(batch(te_texts)).tokens, te_y)
    pred = both.predict(batch(te_texts)).tokens
    tau_both = kendall_tau(pred, te_y)
    assert tau_both > 0.4 and tau_both > tau_words + 0.3, (tau_words, tau_both)  # measured: 0.49 and 0.11
    like_texts, like_y = prompts(400, 6, LONG_SEEN, PLAIN_SEEN)
    assert abs(both.predict(batch(like_texts)).tokens.mean() / like_y.mean() - 1) < 0.1
    path = tmp_path / "lengths.npz"
    both.save(str(path))
    loaded = TrainedPredictor.load(str(path))
    assert loaded.name == "trained"  # not bound to a tokenizer yet: the word model alone
    np.testing.assert_allclose(loaded.predict(batch(te_texts)).tokens, words_of(both).predict(batch(te_texts)).tokens)
    assert loaded.bind(inputs.tokenizer) is None and loaded.name == "trained, with the model's token embeddings"
    np.testing.assert_allclose(loaded.predict(batch(te_texts)).tokens, pred, rtol=1e-5)
    assert loaded.meta["tokens"]["model"] == model and loaded.meta["tokens"]["fingerprint"] == fingerprint(inputs.tokenizer)


def words_of(p):
    """The same predictor unbound: its word model alone."""
    return TrainedPredictor(p.bias, p.wd, p.ws, p.mean, p.std, p.calib, p.meta)


def test_another_tokenizer_leaves_the_word_model_alone(model, tmp_path, caplog):
    """A file fitted on one vocabulary and a job whose model has another (the same words and 100 more): bind says
    why, and the predictions are the word model's."""
    other = write_model(tmp_path / "other", seed=0, vocab_size=700)  # w600..w699 added: another vocabulary
    inputs = TokenInputs.of_model(model)
    texts, y = prompts(120, 3, LONG_SEEN, PLAIN_SEEN)
    p, _ = TrainedPredictor.fit(batch(texts), y, tokens=inputs)
    with_tokens = p.predict(batch(texts)).tokens
    why = p.bind(TokenInputs.of_model(other).tokenizer)
    assert why and "fitted on the vocabulary of" in why and "predictor train" in why
    assert p.name == "trained"
    alone = p.predict(batch(texts)).tokens
    with caplog.at_level(logging.WARNING, logger="overnight"):  # a job's annotator logs it, once a tokenizer
        annotator, tokenizer = LengthAnnotator(p, 2000), TokenInputs.of_model(other).tokenizer
        for _ in range(2):  # (plan binds it again for its second pass)
            annotator.bind(tokenizer)
    assert "predictor: the predictor file's token model was fitted on the vocabulary of" in caplog.text
    assert caplog.text.count("token model was fitted") == 1
    np.testing.assert_allclose(alone, words_of(p).predict(batch(texts)).tokens)
    assert not np.allclose(alone, with_tokens)


def test_the_table_is_the_ridge_on_the_mean_embedding(model):
    """score = bias + mean of table[token] equals the ridge on the standardised mean embedding it was fitted as."""
    inputs = TokenInputs.of_model(model)
    texts, y = prompts(200, 4, LONG_SEEN + LONG_UNSEEN, PLAIN_SEEN + PLAIN_UNSEEN)
    ids = token_ids(inputs.tokenizer, texts)
    table, loo = TokenTable.fit(inputs.emb, ids, y)
    x, has = mean_embeddings(inputs.emb, ids)
    assert has.all()
    mu, sd = x.mean(axis=0), x.std(axis=0) + 1e-6
    a = (x - mu) / sd
    ly = np.log(y)
    w = np.linalg.solve(a.T @ a + table.lam * np.eye(WIDTH), a.T @ (ly - ly.mean()))
    np.testing.assert_allclose(table.scores(ids), ly.mean() + a @ w, atol=1e-4)
    assert kendall_tau(loo, y) > 0.35 and len(loo) == 200  # measured: 0.47
    assert table.scores([[]])[0] == pytest.approx(ly.mean())  # a row without tokens: the mean
    # leave-one-out: what refitting the ridge (its intercept unpenalised) without each row predicts for it
    for i in (0, 57, 199):
        keep = np.arange(200) != i
        centre = a[keep].mean(axis=0)
        w_i = np.linalg.solve((a[keep] - centre).T @ (a[keep] - centre) + table.lam * np.eye(WIDTH),
                              (a[keep] - centre).T @ (ly[keep] - ly[keep].mean()))
        assert loo[i] == pytest.approx(ly[keep].mean() + (a[i] - centre) @ w_i, abs=1e-9)


def test_train_command_reports_the_token_model(model, tmp_path, cfg):
    """`overnight predictor train` over a run served by a model with weights learns its token embeddings and
    says so; `eval` uses them; a model without weights trains the word model and says why."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from click.testing import CliRunner
    from fakes import FakeEngine, given

    from overnight.jobs.cli import cli
    from overnight.pipeline.api import run_job

    texts, y = prompts(80, 5, LONG_SEEN, PLAIN_SEEN)
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(80)], "prompt": texts}), tmp_path / "in.parquet")
    lengths = dict(zip(texts, y))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    engine = FakeEngine(max_num_seqs=16, length_of=lambda ids: int(lengths[tok.decode(ids)]))
    out = tmp_path / "out"
    run_job(cfg(tmp_path / "in.parquet", out, sampling={"max_tokens": 4000}, engine={"model": model},
                prompt={"chat": False}), engine_factory=given(engine), is_tty=False)
    res = CliRunner().invoke(cli, ["predictor", "train", str(out), "--save", str(tmp_path / "p.npz")],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert f"and {model}'s token embeddings (out-of-fold tau on 64 rows" in res.output, res.output
    ev = json.loads(CliRunner().invoke(cli, ["predictor", "eval", str(out), "--predictor", str(tmp_path / "p.npz"),
                                             "--json"], catch_exceptions=False).output)
    assert ev["predictor"].startswith("trained, with the model's token embeddings") and ev["kendall_tau"] > 0.5
    words = CliRunner().invoke(cli, ["predictor", "train", str(out), "--save", str(tmp_path / "w.npz"),
                                     "--no-embeddings"], catch_exceptions=False)
    assert words.exit_code == 0 and "token embeddings" not in words.output
    bad = CliRunner().invoke(cli, ["predictor", "train", str(out), "--save", str(tmp_path / "x.npz"),
                                   "--model", str(tmp_path)])
    assert bad.exit_code == 2 and f"--model {tmp_path}" in bad.output and "--no-embeddings" in bad.output
    both = CliRunner().invoke(cli, ["predictor", "train", str(out), "--save", str(tmp_path / "y.npz"),
                                    "--model", model, "--no-embeddings"])
    assert both.exit_code == 2 and "Pass one or the other" in both.output
    # eval says why a file's token model is left out: here, runs of two models
    import dataclasses

    from overnight.buckets.dataset import load_outputs
    from overnight.buckets.evaluate import evaluate
    data = load_outputs([str(out)])
    e = evaluate(dataclasses.replace(data, models=[model, "other"]), str(tmp_path / "p.npz"))
    assert e.predictor.startswith("trained (") and e.note.startswith("the runs served 2 models")
    assert evaluate(data, str(tmp_path / "p.npz")).note is None
