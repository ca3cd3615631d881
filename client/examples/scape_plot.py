"""scape_plot.py - line charts as standalone SVG, with no plotting library:
the demo and the quality benchmark draw their loss and bytes-per-step curves
with it.  Also reads the trainers' CSV logs."""
import csv
import math
from xml.sax.saxutils import escape

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def read_log(path):
    """A CSV log as a dict of column -> list of floats (nan where empty)."""
    cols = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                try:
                    x = float(v)
                except (TypeError, ValueError):
                    x = float("nan")
                cols.setdefault(k, []).append(x)
    return cols


def finite(xs, ys):
    return [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]


def smooth(ys, window):
    """Trailing mean over `window` points (the first ones over fewer)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _ticks(lo, hi, log):
    if log:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        steps = (1, 2, 5) if b - a <= 3 else (1,)
        return [m * 10.0 ** e for e in range(a, b + 1) for m in steps]
    span = hi - lo or 1.0
    step = 10 ** math.floor(math.log10(span / 4))
    for m in (1, 2, 5, 10):
        if span / (step * m) <= 6:
            step *= m
            break
    t, out = math.ceil(lo / step) * step, []
    while t <= hi + 1e-12:
        out.append(t)
        t += step
    return out


def _fmt(v, log):
    if log:  # bytes, in decimal units so that the decade ticks read round
        for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if v >= scale:
                return "%g %s" % (round(v / scale, 1), unit)
        return "%g B" % v
    return "%g" % round(v, 6)


def panel(title, xlabel, ylabel, series, log=False):
    """series: list of (label, [(x, y)...], dashed)."""
    return {"title": title, "xlabel": xlabel, "ylabel": ylabel, "series": series, "log": log}


def write_svg(path, panels, width=640, height=360):
    """Panels side by side, each with axes, ticks, its series and a legend
    to the right of its plot area."""
    ml, mr, mt, mb = 78, 170, 40, 50
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
           'font-family="sans-serif" font-size="12">' % (width * len(panels), height),
           '<rect width="100%" height="100%" fill="white"/>']
    for p_i, p in enumerate(panels):
        ox = p_i * width
        pts = [pt for _, s, _ in p["series"] for pt in s if not p["log"] or pt[1] > 0]
        if not pts:
            continue
        x0, x1 = min(x for x, _ in pts), max(x for x, _ in pts)
        y0, y1 = min(y for _, y in pts), max(y for _, y in pts)
        if p["log"]:
            y0, y1 = math.log10(y0) - 0.1, math.log10(y1) + 0.1
        else:
            pad = 0.05 * (y1 - y0 or 1.0)
            y0, y1 = y0 - pad, y1 + pad
        x1 = x1 if x1 > x0 else x0 + 1
        w, h = width - ml - mr, height - mt - mb

        def X(x):
            return ox + ml + w * (x - x0) / (x1 - x0)

        def Y(y):
            v = math.log10(y) if p["log"] else y
            return mt + h * (1 - (v - y0) / (y1 - y0))

        out.append('<text x="%g" y="22" font-size="14" font-weight="bold">%s</text>'
                   % (ox + ml, escape(p["title"])))
        out.append('<rect x="%g" y="%g" width="%g" height="%g" fill="none" stroke="#444"/>'
                   % (ox + ml, mt, w, h))
        for t in _ticks(x0, x1, False):
            out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="#ddd"/>'
                       % (X(t), mt, X(t), mt + h))
            out.append('<text x="%g" y="%g" text-anchor="middle">%s</text>'
                       % (X(t), mt + h + 16, _fmt(t, False)))
        lo = 10 ** y0 if p["log"] else y0
        hi = 10 ** y1 if p["log"] else y1
        for t in _ticks(lo, hi, p["log"]):
            if not lo <= t <= hi:
                continue
            out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="#ddd"/>'
                       % (ox + ml, Y(t), ox + ml + w, Y(t)))
            out.append('<text x="%g" y="%g" text-anchor="end">%s</text>'
                       % (ox + ml - 6, Y(t) + 4, _fmt(t, p["log"])))
        out.append('<text x="%g" y="%g" text-anchor="middle">%s</text>'
                   % (ox + ml + w / 2, height - 12, escape(p["xlabel"])))
        out.append('<text x="%g" y="%g" text-anchor="middle" transform="rotate(-90 %g %g)">'
                   '%s</text>' % (ox + 14, mt + h / 2, ox + 14, mt + h / 2,
                                  escape(p["ylabel"])))
        for i, (label, s, dashed) in enumerate(p["series"]):
            s = [(x, y) for x, y in s if not p["log"] or y > 0]
            if len(s) > 800:  # a point per pixel or so is all a reader sees
                step = len(s) // 800 + 1
                s = s[::step] + ([s[-1]] if (len(s) - 1) % step else [])
            if not s:
                continue
            color = COLORS[i % len(COLORS)]
            d = " ".join("%s%.1f,%.1f" % ("M" if j == 0 else "L", X(x), Y(y))
                         for j, (x, y) in enumerate(s))
            out.append('<path d="%s" fill="none" stroke="%s" stroke-width="1.6"%s/>'
                       % (d, color, ' stroke-dasharray="5,3"' if dashed else ""))
            ly = mt + 12 + 18 * i
            lx = ox + ml + w + 12
            out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="%s" stroke-width="2"%s/>'
                       % (lx, ly - 4, lx + 20, ly - 4, color,
                          ' stroke-dasharray="5,3"' if dashed else ""))
            out.append('<text x="%g" y="%g">%s</text>' % (lx + 25, ly, escape(label)))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
