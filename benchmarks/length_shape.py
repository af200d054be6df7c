"""What shape do a run's lengths have against their predictions? Fitted in hindsight on finished runs.

The forecast models r = log(actual / predicted) as one normal (scheduling/lengths.LengthModel, censored at
max_tokens). For each full run folder given, this fits by maximum likelihood on all its rows (rows cut at
max_tokens censored): that log-normal, a two-piece normal in r (its own spread on each side of the mode), and
a normal on the length itself. It prints for each fit the expected token sum against the actual one, and what the
drain at the end of a run needs most: the expected tokens still to come of a row that has generated g,
E[min(L, cap) - g | L > g], averaged over the rows that did run past g, against what they actually generated
after g. "own r" is no fit: each row's prediction times the run's own ratios (every row's r, known in
hindsight), the shape a non-parametric estimate of r would find; "Weibull" is a Weibull in actual / predicted
(its log is skewed to the left). It also prints, for powers of the length 0 (log), 1/4, 1/2 (the square root,
scheduling/lengths.SqrtLengthModel), 3/4 and 1, a censored regression of the Box-Cox transform of the length on
the log prediction: its slope (in Box-Cox units: at 1/2, twice the slope of sqrt(length)), its log-likelihood
(of the length itself) and the same tail check. It also prints r's skew (its 10% and 90% quantiles against the
median; the spread below the median and, of the rows not cut, above it) and the log-normal fitted with the
shortest fifth of the finished rows censored on the left ("r below this"), tried and not kept (docs/BENCHMARKS.md).

    python benchmarks/length_shape.py OUT [OUT ...] [--max-tokens 512]
"""

from __future__ import annotations

import argparse
import math

import numpy as np

GS = (100, 200, 300, 400)
POWERS = (0.0, 0.25, 0.5, 0.75, 1.0)


def censored_line(x, y, cens, iterations: int = 200):
    """y = a + b x + Normal(0, s), y a lower bound where cens: an EM fit."""
    from overnight.pipeline.scheduling.lengths import norm_cdf, norm_pdf

    X = np.c_[np.ones_like(x), x]
    beta = np.linalg.lstsq(X, y, rcond=None)[0]
    s = float(np.std(y - X @ beta))
    for _ in range(iterations):
        m = X @ beta
        z = (y - m) / s
        lam = norm_pdf(z) / np.clip(1 - norm_cdf(z), 1e-12, None)
        ey = np.where(cens, m + s * lam, y)
        ey2 = np.where(cens, m * m + s * s + s * (y + m) * lam, y * y)
        beta = np.linalg.solve(X.T @ X, X.T @ ey)
        m = X @ beta
        s = math.sqrt(max(float(np.mean(ey2 - 2 * m * ey + m * m)), 1e-4))
    return beta, s


def powers(p, a, cut, cap):
    """Each power's fit and its expected / actual tokens still to come of the rows past each g (quadrature)."""
    from overnight.pipeline.scheduling.lengths import norm_cdf, norm_pdf

    x = np.log(p) - np.log(p).mean()
    zs = np.linspace(-6, 6, 241)
    wz = norm_pdf(zs) / norm_pdf(zs).sum()
    lines = []
    for lam in POWERS:
        y = np.log(np.minimum(a, cap)) if lam == 0 else (np.minimum(a, cap) ** lam - 1) / lam
        (b0, b1), s = censored_line(x, y, cut)
        m = b0 + b1 * x
        z = (y - m) / s
        ll = float((-0.5 * z[~cut] ** 2 - math.log(s) + (lam - 1) * np.log(a[~cut])).sum()
                   + np.log(np.clip(1 - norm_cdf(z[cut]), 1e-300, None)).sum())
        q = m[:, None] + s * zs[None, :]
        lengths = np.exp(q) if lam == 0 else np.clip(1 + lam * q, 1e-9, None) ** (1 / lam)
        ratios = []
        for g in GS:
            rows = a > g
            alive = wz[None, :] * (lengths[rows] > g)
            # a row past the grid's last point has about nothing left: at least a token, as the models say
            e = np.maximum((alive * (np.minimum(lengths[rows], cap) - g)).sum(1) / np.clip(alive.sum(1), 1e-12, None),
                           1.0)
            ratios.append(f"g={g} x{np.mean(e) / np.mean(np.minimum(a[rows], cap) - g):.2f}")
        lines.append(f"  power {lam:.2f}: slope {b1:6.2f}, log-likelihood {ll:8.1f}; tokens still to come, expected / "
                     f"actual: " + ", ".join(ratios))
    return lines


def load(out: str):
    import glob

    import duckdb

    if not glob.glob(f"{out}/**/parts/*.parquet", recursive=True):
        raise SystemExit(f"{out} holds no output parts (**/parts/*.parquet): pass the --out folder of a finished "
                         f"`overnight run`")

    r = duckdb.sql(f"select predicted_tokens, output_tokens, finish_reason from read_parquet('{out}/**/parts/*.parquet') "
                   f"where status = 'ok' and predicted_tokens > 0 and output_tokens > 0").fetchnumpy()
    p, a = r["predicted_tokens"].astype(float), r["output_tokens"].astype(float)
    return p, a, r["finish_reason"] == "length"


def main() -> None:
    from overnight.pipeline.scheduling.lengths import LengthModel, norm_cdf

    ap = argparse.ArgumentParser()
    ap.add_argument("outs", nargs="+")
    ap.add_argument("--max-tokens", type=float, default=512)
    args = ap.parse_args()
    cap = args.max_tokens

    def cdf_tp(x, m, sl, sr):
        k = 2 / (sl + sr)
        return np.where(x < m, k * sl * norm_cdf((x - m) / sl), k * sl / 2 + k * sr * (norm_cdf((x - m) / sr) - 0.5))

    def exp_part(lo, hi, m, s, k):  # the integral of e^r k phi((r - m) / s) dr over (lo, hi)
        return k * s * np.exp(m + s * s / 2) * (norm_cdf((hi - m - s * s) / s) - norm_cdf((lo - m - s * s) / s))

    def tp_part(lo, hi, m, sl, sr):  # the same for the two-piece density, over (lo, hi)
        k = 2 / (sl + sr)
        left = np.where(lo < m, exp_part(lo, np.minimum(hi, m), m, sl, k), 0.0)
        return left + np.where(hi > m, exp_part(np.maximum(lo, m), hi, m, sr, k), 0.0)

    print("E[min(L, cap) - g | L > g] over the rows that ran past g: actual, then each model's; token sum: model / "
          "actual")
    for out in args.outs:
        p, a, cut = load(out)
        if len(a) < 20:
            raise SystemExit(f"{out} has {len(a)} finished rows with a prediction; a shape needs 20 or more")
        cut = cut | (a >= cap)
        x = np.log(a / p)
        ex, rc = x[~cut], x[cut]
        # log-normal: a grid over (mu, sigma), then as LengthModel computes its expectations
        best = max(((float((-0.5 * ((ex - mu) / s) ** 2 - math.log(s)).sum()
                           + np.log(np.clip(1 - norm_cdf((rc - mu) / s), 1e-300, None)).sum()), mu, s)
                    for mu in np.arange(-1.0, 1.5, 0.01) for s in np.arange(0.2, 1.5, 0.01)))
        ln = LengthModel(int(cap))
        ln.mu, ln.sigma = best[1], best[2]
        # the same with the shortest fifth of the finished rows censored on the left
        t = float(np.quantile(ex, 0.2))
        hi, n_lo = ex[ex >= t], int((ex < t).sum())
        left = max(((float((-0.5 * ((hi - mu) / s) ** 2 - math.log(s)).sum()
                           + np.log(np.clip(1 - norm_cdf((rc - mu) / s), 1e-300, None)).sum()
                           + n_lo * math.log(max(float(norm_cdf((t - mu) / s)), 1e-300))), mu, s)
                    for mu in np.arange(-1.0, 1.5, 0.01) for s in np.arange(0.2, 1.5, 0.01)))
        lc_model = LengthModel(int(cap))
        lc_model.mu, lc_model.sigma = left[1], left[2]
        med = float(np.median(x))
        below, above = x[x < med] - med, x[(x >= med) & ~cut] - med
        # two-piece normal in r
        tp = max(((float((np.log(2 / (sl + sr)) - 0.5 * ((ex - m) / np.where(ex < m, sl, sr)) ** 2).sum()
                         + np.log(np.clip(1 - cdf_tp(rc, m, sl, sr), 1e-300, None)).sum()), m, sl, sr)
                  for m in np.arange(-0.5, 1.2, 0.02) for sl in np.arange(0.3, 1.6, 0.04)
                  for sr in np.arange(0.2, 1.2, 0.04)))
        _, m, sl, sr = tp
        lp, lcap = np.log(p), math.log(cap)

        def tp_expected(rows, g):
            lo, hi = math.log(g) - lp[rows], lcap - lp[rows]
            e = np.exp(lp[rows]) * tp_part(lo, hi, m, sl, sr) + cap * (1 - cdf_tp(hi, m, sl, sr))
            return e / np.clip(1 - cdf_tp(lo, m, sl, sr), 1e-12, None) - g

        tp_sum = float((np.exp(lp) * tp_part(-np.inf, lcap - lp, m, sl, sr) + cap * (1 - cdf_tp(lcap - lp, m, sl, sr))).sum())
        mm, ss = float(np.minimum(a, cap).mean()), float(np.minimum(a, cap).std())
        # Weibull in actual / predicted (its log is skewed to the left): log S(L) = -(L / (lam p))^k
        y, yc = np.exp(ex), np.exp(rc)
        ly, lyc = np.log(y), np.log(yc)
        wb = max(((float(len(y) * (math.log(k) - k * ll) + (k - 1) * ly.sum() - np.exp(k * (ly - ll)).sum()
                         - np.exp(k * (lyc - ll)).sum()), k, ll)
                  for k in np.arange(0.6, 4.0, 0.02) for ll in np.arange(-1.0, 1.5, 0.01)))
        _, wk, wl = wb

        def wb_expected(rows, g):
            zs = np.linspace(0.0, 1.0, 401)[None, :]
            xs = g + zs * (cap - np.full((len(rows), 1), float(g)))
            scale = np.exp(wl) * p[rows][:, None]
            surv = np.exp(-(xs / scale) ** wk)
            return np.trapezoid(surv, xs, axis=1) / np.clip(surv[:, 0], 1e-300, None)

        def wb_sum():
            xs = np.linspace(0.0, cap, 801)[None, :]
            return float(np.trapezoid(np.exp(-(xs / (np.exp(wl) * p[:, None])) ** wk), xs, axis=1).sum())
        print(f"\n{out}: {len(a)} rows, {cut.mean():.0%} cut at max_tokens")
        q10, q90 = np.quantile(x, [0.1, 0.9])
        print(f"  r: 10% quantile {q10 - med:+.2f} and 90% {q90 - med:+.2f} from the median; spread below it "
              f"{math.sqrt(float(np.mean(below ** 2))):.2f}, above it (not cut) {math.sqrt(float(np.mean(above ** 2))):.2f}, "
              f"both sides {float(x.std()):.2f}")
        print(f"  log-normal mu {ln.mu:+.2f} sigma {ln.sigma:.2f}, sum x{ln.moments(p)[0].sum() / a.sum():.2f}; two-piece "
              f"mode {m:+.2f} left {sl:.2f} right {sr:.2f}, sum x{tp_sum / a.sum():.2f}; shortest fifth censored on "
              f"the left: mu {lc_model.mu:+.2f} sigma {lc_model.sigma:.2f}, sum x{lc_model.moments(p)[0].sum() / a.sum():.2f}; "
              f"Weibull k {wk:.2f} log scale {wl:+.2f}, sum x{wb_sum() / a.sum():.2f}")
        for g in GS:
            rows = np.flatnonzero(a > g)
            if len(rows) < 5:
                continue
            actual = float(np.mean(np.minimum(a[rows], cap) - g))
            own = np.minimum(p[rows][:, None] * np.exp(x[None, :]), cap)
            own_r = float(np.mean([np.mean(v[v > g] - g) if (v > g).any() else 0.0 for v in own]))
            zs = np.linspace(g, cap, 400)
            dens = np.exp(-0.5 * ((zs - mm) / ss) ** 2) / (ss * math.sqrt(2 * math.pi))
            normal = (float(np.trapezoid((zs - g) * dens, zs)) + (cap - g) * (1 - float(norm_cdf((cap - mm) / ss)))) / \
                max(1 - float(norm_cdf((g - mm) / ss)), 1e-12)
            print(f"  g={g:3d} ({len(rows):3d} rows): actual {actual:4.0f} | log-normal "
                  f"{np.mean(ln.expected(p[rows], np.full(len(rows), float(g)))):4.0f} | two-piece "
                  f"{np.mean(tp_expected(rows, g)):4.0f} | Weibull {np.mean(wb_expected(rows, g)):4.0f} | own r {own_r:4.0f} | "
                  f"normal on length {normal:4.0f}")
        print("\n".join(powers(p, a, cut, cap)))


if __name__ == "__main__":
    main()
