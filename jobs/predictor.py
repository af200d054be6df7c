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
@user_errors
def train(outs, save_to, epochs, holdout, seed):
    """Fit a length model on earlier runs' outputs (their actual output lengths).

    A linear model of log length over the prompt's words, its kind of task and
    its token counts, with penalties chosen by cross-validation on the
    training rows and its mean calibrated to the mean actual length. It
    reports the cross-validated Kendall's tau (what new rows should see) and,
    on the --holdout rows, tau, MAE and mean predicted / mean actual.

    \b
    Example:
        overnight predictor train results/night1 results/night2 --save lengths.pt
    """
    from overnight.buckets.dataset import load_outputs
    from overnight.buckets.features import stack
    from overnight.buckets.trained import TrainedPredictor

    data = load_outputs(list(outs))
    train_idx, val_idx = data.split(holdout, seed) if holdout else (list(range(len(data))), [])
    rows = data.features.rows()
    fb_train = stack([rows[i] for i in train_idx])
    fb_val = stack([rows[i] for i in val_idx]) if len(val_idx) else None
    p, report = TrainedPredictor.fit(fb_train, data.actual[train_idx], data.hit_cap[train_idx], seed=seed,
                                     holdout=fb_val, holdout_actual=data.actual[val_idx] if len(val_idx) else None,
                                     sources=list(outs))
    p.save(save_to)
    cv = f"cross-validated Kendall's tau {report.cv_tau:.3f}, " if report.cv_tau is not None else ""
    val = (f"; validation tau {report.val_tau:.3f}, MAE {report.val_mae:.0f} tokens, mean predicted / actual "
           f"{report.val_calibration:.2f} on {len(val_idx)} held-out rows" if report.val_tau is not None else "")
    words = "without the hashed words" if report.config["lam_sparse"] == float("inf") else "with the hashed words"
    click.echo(f"trained on {report.num_rows} rows in {report.seconds:.1f} s ({words}): {cv}on the training rows "
               f"themselves {report.train_tau:.3f}{val} -> {save_to}")


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

    e = evaluate(load_outputs([out]), spec)
    if as_json:
        click.echo(json.dumps(asdict(e), indent=2))
        return
    click.echo(f"predictor: {e.predictor}\nrows: {e.num_rows}\nKendall's tau: {e.kendall_tau:.3f}\n"
               f"MAE: {e.mae:.1f} tokens (mean actual {e.mean_actual:.1f}, mean predicted {e.mean_predicted:.1f})\n"
               f"bucket hit rate: {e.bucket_hit_rate:.1%}")
