"""`overnight predictor`: train an output-length predictor on earlier runs, and evaluate predictors."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from overnight.jobs.options import user_errors


@click.group()
def predictor() -> None:
    """Output-length predictors: train on finished runs, evaluate on them.

    \b
    Example:
        overnight predictor train results/monday results/tuesday --save lengths.pt
        overnight predictor eval results/wednesday --predictor lengths.pt
        overnight run prompts.parquet --out results/thursday --predictor lengths.pt
    """


@predictor.command()
@click.argument("outs", nargs=-1, required=True, metavar="OUT...")
@click.option("--save", "save_to", required=True, help="File to write the trained predictor to.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, hidden=True,
              help="Ignored: the model is linear now (format 2's torch model had epochs). Kept for old scripts.")
@click.option("--holdout", type=click.FloatRange(0, 0.9), default=0.2, show_default=True,
              help="Share of rows kept out of training to report validation Kendall's tau.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--model", default=None,
              help="The model whose token embeddings it also learns from (alias, folder or downloaded hub id). "
                   "[default: the model the runs served]")
@click.option("--no-embeddings", is_flag=True, help="Learn from the prompt's words alone, not from the model's "
                                                    "token embeddings.")
@user_errors
def train(outs, save_to, epochs, holdout, seed, model, no_embeddings):
    """Fit a length model on earlier runs' outputs (their actual output lengths).

    A linear model of log length over the prompt's words, its kind of task and
    its token counts, with penalties chosen by cross-validation on the
    training rows and its mean calibrated to the mean actual length. Beside
    it, where the model's weights are on this machine, a ridge on the mean of
    the model's own embeddings of the prompt's tokens; the two are averaged.
    Jobs that serve a model with another tokenizer use the word model alone.
    It reports the cross-validated Kendall's tau (what new rows should see)
    and, on the --holdout rows, tau, MAE and mean predicted / mean actual.

    \b
    Example:
        overnight predictor train results/night1 results/night2 --save lengths.pt
    """
    from overnight.buckets.dataset import load_outputs
    from overnight.buckets.features import stack
    from overnight.buckets.trained import TrainedPredictor
    from overnight.pipeline.output.storage import unwritable

    why = unwritable(save_to)
    if why:  # before the training, not after it
        raise click.BadParameter(f"{save_to} cannot be written: {why}", param_hint="--save")
    if model and no_embeddings:
        raise click.UsageError("--model names the model whose token embeddings to learn from; --no-embeddings "
                               "learns from none. Pass one or the other.")
    data = load_outputs(list(outs), one_per_prompt=True)
    if data.num_repeats:
        click.echo(f"{data.num_repeats} rows left out: their prompts come again in a later row, which is kept (no "
                   f"prompt sits on both sides of a split); {len(data)} distinct prompts remain")
    _check_learnable(data)
    tokens, why_not = None, None
    if not no_embeddings:
        tokens, why_not = _token_inputs(model, data.models)
    train_idx, val_idx = data.split(holdout, seed) if holdout else (list(range(len(data))), [])
    if len(train_idx) < MIN_ROWS:
        from overnight.buckets.dataset import DatasetError

        raise DatasetError(f"--holdout {holdout:g} leaves {len(train_idx)} of {len(data)} rows to train on, too few "
                           f"(at least {MIN_ROWS}); lower --holdout (0 trains on every row), or train on more rows.")
    rows = data.features.rows()
    fb_train = stack([rows[i] for i in train_idx])
    fb_val = stack([rows[i] for i in val_idx]) if len(val_idx) else None
    p, report = TrainedPredictor.fit(fb_train, data.actual[train_idx], data.hit_cap[train_idx], seed=seed,
                                     holdout=fb_val, holdout_actual=data.actual[val_idx] if len(val_idx) else None,
                                     sources=list(outs), tokens=tokens)
    p.meta["served_models"] = list(data.models)  # whose lengths it learned: a job of another model is warned
    p.save(save_to)
    cv = f"cross-validated Kendall's tau {report.cv_tau:.3f}, " if report.cv_tau is not None else ""
    val = (f"; validation tau {report.val_tau:.3f}, MAE {report.val_mae:.0f} tokens, mean predicted / actual "
           f"{report.val_calibration:.2f} on {len(val_idx)} held-out rows" if report.val_tau is not None else "")
    words = "without the hashed words" if report.config["lam_sparse"] == float("inf") else "with the hashed words"
    if report.tokens is not None:
        t = report.tokens
        words += (f", and {tokens.model}'s token embeddings (out-of-fold tau on {t['num_rows']} rows: words "
                  f"{t['words_cv_tau']:.3f}, token embeddings {t['tokens_cv_tau']:.3f}, both {t['cv_tau']:.3f})")
    elif tokens is not None:
        words += ", without the token embeddings (too few rows to cross-validate)"
    click.echo(f"trained on {report.num_rows} rows in {report.seconds:.1f} s ({words}): {cv}on the training rows "
               f"themselves {report.train_tau:.3f}{val} -> {save_to}")
    if why_not:
        click.echo(f"token embeddings not used: {why_not}")


MIN_ROWS = 8  # the fewest the cross-validation of the penalties can split


def _check_learnable(data) -> None:
    """Refuse rows that cannot teach lengths (too few, all of one length); warn where most were cut short."""
    import numpy as np

    from overnight.buckets.dataset import DatasetError

    n = len(data)
    if n < MIN_ROWS:
        raise DatasetError(f"{n} finished ok rows are too few to train on (at least {MIN_ROWS}); train on a run "
                           f"with more rows, or on several runs together.")
    if float(np.ptp(data.actual)) == 0:
        raise DatasetError(f"every row has the same output length ({data.actual[0]:.0f} tokens), so there is no "
                           f"length to learn; train on a run with a max_tokens its answers do not all reach.")
    cut = float(np.mean(data.hit_cap))
    if cut > 0.5:
        click.echo(f"warning: {cut:.0%} of the rows were cut at max_tokens, so their lengths are only a lower "
                   f"bound, and the predictor knows little of how long they would run. Train on a run with a "
                   f"larger --max-tokens to predict for jobs with a larger one.", err=True)


def _token_inputs(model, served):
    """(TokenInputs, None), or (None, why not) when the default model's embeddings cannot be read here; a
    --model given that cannot be read is an error."""
    from overnight.buckets.tokens import EmbeddingsUnavailable, TokenInputs
    from overnight.pipeline.tools.models import ModelError

    name = model or (served[0] if len(served) == 1 else None)
    if name is None:
        why = (f"the runs served {len(served)} models ({', '.join(served)})" if served else
               "the runs do not say which model served them")
        return None, f"{why}; pass --model MODEL"
    try:
        return TokenInputs.of_model(name), None
    except Exception as e:  # not there, not prepared, a missing or corrupt shard ...
        why = str(e) if isinstance(e, (EmbeddingsUnavailable, ModelError)) else f"{type(e).__name__}: {e}"
        if model:
            raise click.UsageError(f"--model {model}: its token embeddings cannot be read: {why}. Pass a model "
                                   f"folder with its .safetensors weights, or --no-embeddings.") from None
        return None, f"{why}; pass --model FOLDER with the weights of {name}, or --no-embeddings"


@predictor.command("eval")
@click.argument("out")
@click.option("--predictor", "spec", help="heuristic, online, or a file from `predictor train`. "
                                          "[default: the predictions stored in the run]")
@click.option("--json", "as_json", is_flag=True)
@user_errors
def eval_cmd(out, spec, as_json):
    """How well predicted lengths matched actual ones on a finished run.

    Reports Kendall's tau, mean absolute error in tokens, and how often a row's
    predicted bucket was its actual bucket.

    \b
    Example:
        overnight predictor eval results/
        overnight predictor eval results/ --predictor lengths.pt
    """
    from overnight.buckets.dataset import load_outputs
    from overnight.buckets.evaluate import evaluate

    e = evaluate(load_outputs([out], need_prompt=spec is not None), spec)
    if as_json:
        # NaN (tau of fewer than 2 rows, say) is not JSON: null
        click.echo(json.dumps({k: None if isinstance(v, float) and v != v else v for k, v in asdict(e).items()},
                              indent=2))
        return
    click.echo(f"predictor: {e.predictor}\nrows: {e.num_rows}\nKendall's tau: {e.kendall_tau:.3f}\n"
               f"MAE: {e.mae:.1f} tokens (mean actual {e.mean_actual:.1f}, mean predicted {e.mean_predicted:.1f})\n"
               f"bucket hit rate: {e.bucket_hit_rate:.1%}" + (f"\nnote: {e.note}" if e.note else ""))
