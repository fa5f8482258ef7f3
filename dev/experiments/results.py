"""results.py [DIR] [--summary] [--readme]: the page DIR.md from the logs DIR/logs/*/*.log and the plots
DIR/plots/*.png (default DIR: $EXP_OUT, else dev/results/studies); --summary also prints a short table
of every run, --readme the README's table (markdown). Every number on the page is read from a log. For
the study scripts' own folder (their default EXP_OUT), the runs they list (their EXP_QUEUE, default
settings) without a complete log are named as missing. Standard library only."""
import glob
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logparse import divergence, parse, worst_spike, worst_val_rise  # noqa: E402

ARGS = [a for a in sys.argv[1:] if not a.startswith('--')]
OUT = os.path.normpath(ARGS[0] if ARGS else os.environ.get('EXP_OUT', 'dev/results/studies'))
PAGE = OUT + '.md'                  # the page sits beside its folder: studies.md links studies/...
LINK = os.path.basename(OUT)        # the folder as the page's links name it
SUMMARY = '--summary' in sys.argv   # also print a short table of every run
README = '--readme' in sys.argv     # also print the README's table
HERE = os.path.dirname(os.path.abspath(__file__))
STUDIES_OUT = os.path.join(HERE, '..', 'results', 'studies')   # common.sh's default EXP_OUT


def f4(x):
    return '—' if x is None else f'{x:.4f}'


def status(r):
    if 'skipped' in r['header']:
        return 'skipped: ' + r['header']['skipped']
    if r['error']:
        return 'failed: ' + r['error'][len('error: '):]
    why = divergence(r)
    if why:
        return '**diverged**: ' + '; '.join(why)
    return 'ok' if r['complete'] else 'incomplete (no final report)'


def bytes_per_param(r):
    if r['bpp'] is None:
        return '—'
    return f"{r['bpp']:.3f}" + (f" (+ {r['scratch']:.3f} release scratch)" if r['scratch'] is not None else '')


def speed(r):
    if r['speed'] is None:
        return '—'
    # EXP_SHARD: several runs at once on one device, so the speed is a share of it
    return f"{r['speed']:.0f}" + (' (shared)' if 'shared' in r['header'] else '')


def memory(r):
    return '—' if not r['mem'] else f"{r['mem'] / 1e9:.2f} GB"


def where(r):
    """The GPU (the trainer's first line), the date and the commit of a run."""
    if not r['device']:
        return '—'
    gpu = r['device'].replace('GPU NVIDIA ', '').replace(' (bf16 model)', '')
    return f"{gpu}, {r['header'].get('date', '?')[:16]}, `{r['header'].get('commit', '?')}`"


def table(head, rows):
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
    return '\n'.join(lines) + '\n'


def order(r):
    """Runs grouped by their name's first part (optimizer, or learning rate: lr6e-4 before lr3e-3),
    the fp32 run first in each group."""
    group = r['name'].split('_')[0]
    try:
        group = float(group[2:]) if group.startswith('lr') else group
    except ValueError:
        pass
    return (str(type(group)), group, '_fp32' not in r['name'], r['name'])


def plot_order(png):
    """Plots in the order of their runs: ..._adamw, _lion, _sgd; ..._lr6e-4 before ..._lr3e-3."""
    part = os.path.basename(png)[:-4].split('_')[-1]
    return order(dict(name=part + '_'))[:2]


def lean_plot_order(png):
    """Study 5's plots: by model (d12 before d24), then recipes, release, ablations."""
    part = os.path.basename(png)[:-4][len('study5_lean_'):]
    model, _, what = part.partition('-')
    m = re.match(r'd(\d+)', model)
    return (int(m[1]) if m else 0, model, ['', 'release', 'ablations'].index(what) if what in ('', 'release', 'ablations') else 3)


def runs_of(study):
    return sorted((parse(p) for p in glob.glob(os.path.join(OUT, 'logs', study, '*.log'))), key=order)


def ran(r):
    return r['final_val'] is not None and 'skipped' not in r['header']


def seed(r):
    return r['flags'].get('-d', '1337')   # every study passes -d; 1337 is the trainer's default


def released(r):
    return r['flags'].get('-R', '0') != '0'


def seed_runs(study):
    """The runs a comparison over seeds takes: AdamW, complete, without release or another block size."""
    return [r for r in runs_of(study)
            if r['optim'] == 'adamw' and not released(r) and '-K' not in r['flags'] and ran(r) and r['complete']]


def seed_spread(study='study3_seeds'):
    """fp32 AdamW's final val loss over the seeds of a study (study 3: d12; study 4 runs its size's
    own seeds), without release: (values, max - min, sample std)."""
    vals = [r['final_val'] for r in seed_runs(study) if r['recipe'] == 'fp32' and math.isfinite(r['final_val'])]
    if len(vals) < 2:
        return vals, None, None
    return vals, max(vals) - min(vals), statistics.stdev(vals)


def is_ref(r):
    """The fp32 reference of a study-1 style table: recipe fp32, no release, named ..._fp32 (or
    ..._fp32_seedN: the reference of the runs of that seed)."""
    return r['recipe'] == 'fp32' and not released(r) and \
        re.search(r'_fp32(_seed\d+)?$', r['name']) is not None and r['complete'] and ran(r)


def refs(runs):
    """Each (optimizer, seed)'s fp32 reference among runs."""
    return {(r['optim'], seed(r)): r for r in runs if is_ref(r)}


def ref_of(ref, r):
    return ref.get((r['optim'], seed(r)))


def study1(md, study='study1_recipes', spread_of='study3_seeds'):
    runs = runs_of(study)
    vals, spread, _ = seed_spread(spread_of)
    md.append('Final val loss against fp32 with the same optimizer and seed. Tolerance: the larger of the fp32 '
              f'seed spread (max - min over {spread_of}\'s seeds, AdamW: {len(vals)}) and 1% of the fp32 run\'s '
              'final val loss. '
              'Every run clips as its `-g` says (commands below); a release run (`-R 1`) with `-g` above 0 clips '
              'with the trainer\'s rule under release (`-N`, on each log\'s optim line: this step\'s norm does '
              'not exist yet when a layer is stepped), and `_g0` twins, where present, are unclipped runs '
              'without release.\n')
    if spread is None:
        md.append(f'No seed spread yet ({spread_of} has fewer than 2 complete fp32 runs): the tolerance is 1% alone.\n')
    ref = refs(runs)
    rows = []
    for r in runs:
        f = r['flags']
        setup = ' '.join(f'{k} {f[k]}' for k in ('-K', '-M', '-R', '-d') if k in f and (k, f[k]) not in (('-R', '0'), ('-d', '1337'))) or '—'
        delta = within = '—'
        base = ref_of(ref, r)
        if base and ran(r) and r is not base:
            b, x = base['final_val'], r['final_val']
            tol = max(spread or 0.0, 0.01 * b)
            delta = f'{100 * (x - b) / b:+.2f}%'
            within = (f'yes (≤ {tol:.4f})' if abs(x - b) <= tol else f'**no** (> {tol:.4f})') \
                if math.isfinite(x) else '**no** (non-finite)'
        rows.append([f"`{r['name']}`", r['optim'] or '—', r['recipe'] or '—', setup, f.get('-g', '—'),
                     f4(r['final_val']), delta, within, speed(r), bytes_per_param(r), memory(r), where(r), status(r)])
    md.append(table(['run', 'optimizer', 'recipe', 'flags', 'clip (-g)', 'final val loss', 'vs fp32', 'within tolerance',
                     'tokens/s', 'persistent bytes/param', 'device memory (measured)', 'GPU, date, commit', 'status'], rows))
    line = seeds_line(study)
    if line:
        md.append('\nOver the seeds (AdamW, no release): ' + line + '\n')


def seeds_line(study):
    """Each recipe's mean final val loss over its seeds (where it has 2 or more) and the fp32 spread; '' if none."""
    by = {}
    for r in seed_runs(study):
        by.setdefault(r['recipe'], {})[seed(r)] = r['final_val']
    means = [f"`{k}` mean {statistics.mean(v.values()):.4f} over {len(v)} seeds ({', '.join(f'{x:.4f}' for x in v.values())})"
             for k, v in by.items() if len(v) >= 2]
    _, spread, _ = seed_spread(study)
    return '; '.join(means) + (f'; fp32 spread (max - min) **{spread:.4f}**.' if spread is not None else '.') if means else ''


def study2(md):
    md.append('AdamW. Map and block: `-M` and `-K` as given (the trainer\'s defaults: dynamic map, blocks '
              'of 256). Worst val rise: the largest rise of the val loss above its lowest value so far; '
              'worst spike: the largest step loss above the mean of the steps before it (a window).\n')
    rows = []
    for r in runs_of('study2_ablations'):
        f, eight, done = r['flags'], r['recipe'] == '8bit', ran(r)
        rows.append([f"`{r['name']}`", r['lr'] or '—', r['recipe'] or '—',
                     f.get('-M', 'dynamic') if eight else '—', {'0': 'none (per tensor)'}.get(f.get('-K', '256'), f.get('-K', '256')) if eight else '—',
                     r['stable'] or '—', f4(r['final_val']),
                     f4(min((x for _, x in r['val'] if math.isfinite(x)), default=None)),
                     f4(worst_val_rise(r) if done else None), f4(worst_spike(r) if done else None),
                     r['skipped_steps'] if done else '—', speed(r), bytes_per_param(r), memory(r), where(r), status(r)])
    md.append(table(['run', 'peak lr', 'recipe', 'map', 'block', 'StableEmbedding', 'final val loss',
                     'lowest val loss', 'worst val rise', 'worst spike', 'skipped steps', 'tokens/s',
                     'persistent bytes/param', 'device memory (measured)', 'GPU, date, commit', 'status'], rows))


def study3(md):
    rows = [[f"`{r['name']}`", r['flags'].get('-d', '—'), r['recipe'] or '—', f4(r['final_val']), speed(r),
             bytes_per_param(r), memory(r), where(r), status(r)] for r in runs_of('study3_seeds')]
    md.append(table(['run', 'seed', 'recipe', 'final val loss', 'tokens/s', 'persistent bytes/param',
                     'device memory (measured)', 'GPU, date, commit', 'status'], rows))
    vals, spread, std = seed_spread()
    if spread is not None:
        md.append(f'\nfp32 final val loss over {len(vals)} seeds: mean {statistics.mean(vals):.4f}, '
                  f'spread (max - min) **{spread:.4f}**, sample standard deviation {std:.4f}.\n')


def fp32_seeds():
    """{(model, shape, lr): {seed: run}}: fp32 AdamW without release over the seeds of studies 3 and 4,
    the reference of study 5's runs of the same model, shape and peak learning rate."""
    out = {}
    for study in ('study3_seeds', 'study4_scale'):
        for r in seed_runs(study):
            if r['recipe'] == 'fp32' and math.isfinite(r['final_val']):
                out.setdefault((r['model'], r['shape'], r['lr']), {})[seed(r)] = r
    return out


def done(r):
    """A run to compare: complete, with a final val loss."""
    return ran(r) and r['complete']


def against_fp32(r, seeds):
    """Study 5's columns of a run against its fp32 seeds: vs the same seed's run, vs the seeds' mean,
    the quality bar: no worse than the same seed's run by more than the tolerance (the larger of the
    seeds' spread and 1% of that run). The bar is one-sided because it asks whether a recipe loses
    quality; a run lower by more than the tolerance passes it but reads "better", for the page to say why."""
    group = seeds.get((r['model'], r['shape'], r['lr']), {})
    base = group.get(seed(r))
    if not done(r) or not base or r is base:
        return ['—', '—', '—']
    b, x = base['final_val'], r['final_val']
    vals = [g['final_val'] for g in group.values()]
    spread = max(vals) - min(vals) if len(vals) >= 2 else 0.0
    tol = max(spread, 0.01 * b)
    mean = statistics.mean(vals)
    if not math.isfinite(x):
        within = '**no** (non-finite)'
    elif x - b > tol:
        within = f'**no** (+{x - b:.4f} > {tol:.4f})'
    else:
        within = f'yes (≤ {tol:.4f})' if b - x <= tol else f'yes, **better** by {b - x:.4f} (> {tol:.4f})'
    return [f'{100 * (x - b) / b:+.2f}%', f'{100 * (x - mean) / mean:+.2f}% ({len(vals)} seeds)', within]


# Study 5's ablations: run NAME_<suffix> is run NAME (its recipe) with the flags that make the ablation.
ABLATIONS = {'zeromap': "v's map with zero in it", 'rank1': 'rank-1 normalization of v (the recipe: blocks only)',
             'nearest': 'nearest rounding without a master'}


def cmd_flags(r):
    """{flag: value} of a run's trainer command, every flag (the last of each, as the trainer)."""
    words = [w for w in r['header'].get('cmd', '').split() if '=' not in w][1:]
    return dict(zip(words[0::2], words[1::2]))


def changed(r, base):
    """The flags of r's command that its recipe's run does not have with the same value."""
    a, b = cmd_flags(r), cmd_flags(base)
    return ' '.join(f'{k} {v}' for k, v in a.items() if b.get(k) != v) or 'none'


def lean_rows(study):
    """Study 5's runs: (name, its log's parse or None for a run the script lists without a log), the
    listed runs first in the script's order, then any other log there."""
    runs = {r['name']: r for r in runs_of(study)}
    names = [name for s, name, _ in queued() or [] if s == study]
    return [(n, runs.get(n)) for n in names] + [(n, r) for n, r in sorted(runs.items()) if n not in names]


def absent(first, n):
    """A table row of n columns for a listed run that has no log yet, its first columns given."""
    return first + ['—'] * (n - len(first) - 1) + ['missing: no log yet']


def what_run(name, r, flags):
    """Model, recipe and release of a run: from its log, else (no log, or a skipped run's) from the
    flags the study script lists it with."""
    if r is not None and r['model']:
        return r['model'], r['recipe'] or '—', 'yes' if released(r) else 'no'
    return flags.get('-e', name.split('_')[0]), flags.get('-r', '—'), 'yes' if flags.get('-R', '0') != '0' else 'no'


def study5(md, study='study5_lean'):
    seeds = fp32_seeds()
    listed = {name: dict(zip(fl[0::2], fl[1::2])) for s, name, fl in queued() or [] if s == study}
    runs = lean_rows(study)
    md.append('AdamW. Final val loss against fp32 with the same model, batch, schedule and seed (1337): study 3\'s '
              'runs at d12, study 4\'s at d24, whose seeds also give the mean and the tolerance: the larger of their '
              'spread (max - min) and 1% of the seed-1337 run\'s final val loss. The bar is one-sided (no worse than fp32 by '
              'more than the tolerance): a run lower by more reads "better" and passes. A release run (`-R 1`) is compared '
              'with fp32 without release; it clips with the trainer\'s rule under release (`-N`, on its log\'s optim '
              'line). A run the study script lists without a log yet is named as missing.\n')
    for (model, shape, lr), group in sorted(seeds.items()):
        vals = [g['final_val'] for g in group.values()]
        if len(vals) >= 2:
            md.append(f'- fp32 {model} ({shape}, peak lr {lr}), seeds {", ".join(sorted(group))}: mean '
                      f'{statistics.mean(vals):.4f}, spread **{max(vals) - min(vals):.4f}**.')
    md.append('')
    lean_recipes(md, [(n, r) for n, r in runs if n.rpartition('_')[2] not in ABLATIONS], listed, seeds)
    md.append('The ablations: each beside the run of its recipe (the same name without the last part); '
              '"changed" is what its trainer command has that the recipe\'s does not.\n')
    lean_ablations(md, runs, listed, seeds)


def lean_recipes(md, runs, listed, seeds):
    head = ['run', 'model', 'recipe', 'release', 'final val loss', 'vs fp32', 'vs fp32 seed mean', 'quality bar',
            'tokens/s', 'persistent bytes/param', 'device memory (measured)', 'GPU, date, commit', 'status']
    rows, ok, compared = [], 0, 0
    for name, r in runs:
        first = [f'`{name}`', *what_run(name, r, listed.get(name, {}))]
        if r is None:
            rows.append(absent(first, len(head)))
            continue
        vs = against_fp32(r, seeds)
        compared += vs[2] != '—'
        ok += vs[2].startswith('yes')
        rows.append(first + [f4(r['final_val'])] + vs + [speed(r), bytes_per_param(r), memory(r), where(r), status(r)])
    md.append(table(head, rows))
    if compared:
        md.append(f'\nAt the quality bar: {ok} of the {compared} runs compared.\n')
    lean_seed_means(md, [r for _, r in runs if r is not None and done(r) and not released(r)], seeds)


def lean_seed_means(md, runs, seeds):
    """A recipe run with two or more seeds on one model: its mean and spread beside fp32's over the
    same seeds, which says whether a difference at one seed is more than seed noise."""
    by = {}
    for r in runs:
        by.setdefault((r['model'], r['shape'], r['lr'], r['recipe']), {})[seed(r)] = r['final_val']
    for (model, shape, lr, recipe), vals in sorted(by.items()):
        base = seeds.get((model, shape, lr), {})
        common = sorted(d for d in vals if d in base)
        if recipe == 'fp32' or len(common) < 2:
            continue
        mine = [vals[d] for d in common]
        ref = [base[d]['final_val'] for d in common]
        md.append(f'- `{recipe}` {model} over seeds {", ".join(common)}: mean {statistics.mean(mine):.4f} '
                  f'(spread {max(mine) - min(mine):.4f}), fp32 over the same seeds {statistics.mean(ref):.4f} '
                  f'(spread {max(ref) - min(ref):.4f}): {100 * (statistics.mean(mine) - statistics.mean(ref)) / statistics.mean(ref):+.2f}%.')
    md.append('')


def lean_ablations(md, runs, listed, seeds):
    head = ['run', 'ablation', 'recipe', 'changed', 'final val loss', 'vs its recipe', 'vs fp32', 'quality bar',
            'worst val rise', 'worst spike', 'skipped steps', 'tokens/s', 'persistent bytes/param',
            'device memory (measured)', 'GPU, date, commit', 'status']
    rows, by_name = [], dict(runs)
    for name, r in runs:
        base_name, _, what = name.rpartition('_')
        if what not in ABLATIONS:
            continue
        first = [f'`{name}`', ABLATIONS[what], what_run(name, r, listed.get(name, {}))[1]]
        if r is None:
            rows.append(absent(first, len(head)))
            continue
        base = by_name.get(base_name)
        base = base if base is not None and done(base) else None
        rel = f"{100 * (r['final_val'] - base['final_val']) / base['final_val']:+.2f}%" if done(r) and base else '—'
        vs, has = against_fp32(r, seeds), ran(r)
        rows.append(first + [changed(r, base) if base else '—', f4(r['final_val']), rel, vs[0], vs[2],
                             f4(worst_val_rise(r) if has else None), f4(worst_spike(r) if has else None),
                             r['skipped_steps'] if has else '—', speed(r), bytes_per_param(r), memory(r), where(r),
                             status(r)])
    md.append(table(head, rows))


STUDIES = [('study1_recipes', 'Study 1: recipes', study1),
           ('study2_ablations', 'Study 2: the paper\'s ablations', study2),
           ('study3_seeds', 'Study 3: seed noise', study3),
           ('study4_scale', 'Study 4: one more size', lambda md: study1(md, 'study4_scale', 'study4_scale')),
           ('study5_lean', 'Study 5: lean recipes (4-bit states, no master)', study5)]


def commands(md, study, runs):
    settings = sorted({r['header']['settings'] for r in runs if 'settings' in r['header']})
    md.append('Reproduce (a complete log is kept; `EXP_FORCE=1` reruns it):\n\n```\n' +
              ''.join(f'{s} bash dev/experiments/{study}.sh\n' for s in settings) + '```\n')
    cmds = [f"# {r['name']} (commit {r['header'].get('commit', '?')}, {r['header'].get('date', '?')})\n"
            f"{r['header']['cmd']}\n" for r in runs if 'cmd' in r['header']]
    if cmds:
        md.append('<details><summary>the trainer commands</summary>\n\n```\n' + ''.join(cmds) + '```\n</details>\n')


QUEUED = []


def queued():
    """The runs the study scripts list (run and same lines of their EXP_QUEUE), in the scripts' order:
    [(study, name, the run's flags (a copy's: none))]; None where OUT is not the scripts' default folder
    (another series, made with other settings)."""
    if not os.path.isdir(OUT) or not os.path.samefile(OUT, STUDIES_OUT):
        return None
    if not QUEUED:
        with tempfile.NamedTemporaryFile('r') as q:
            for study, _, _ in STUDIES:
                env = dict(os.environ, EXP_QUEUE=q.name, EXP_OUT=OUT)
                subprocess.run(['bash', os.path.join(HERE, study + '.sh')], env=env, stdout=subprocess.DEVNULL, check=True)
            for line in q.read().splitlines():
                kind, study, name, *flags = line.split()
                QUEUED.append((study, name, flags if kind == 'run' else []))
    return QUEUED


def missing():
    """The listed runs (queued) that have no complete log in OUT; None as queued."""
    if queued() is None:
        return None
    out = []
    for study, name, _ in queued():
        path = os.path.join(OUT, 'logs', study, name + '.log')
        r = parse(path) if os.path.exists(path) else None
        if r is None or not r['complete'] or 'skipped' in r['header']:
            out.append(f'{study}/{name}')
    return out


def readme_table():
    """The README's table: study 1's AdamW runs and study 4's, against fp32, with the seed spread."""
    _, spread, _ = seed_spread()
    rows = []
    for study in ('study1_recipes', 'study4_scale'):
        runs = runs_of(study)
        ref = refs(runs)
        for r in runs:
            if r['optim'] != 'adamw' or not ran(r) or seed(r) != '1337':
                continue   # the other seeds: on the page, their means below the table
            base, f = ref_of(ref, r), r['flags']
            setup = ' '.join(f'{k} {f[k]}' for k in ('-K', '-R') if k in f and (k, f[k]) != ('-R', '0'))
            delta = f"{100 * (r['final_val'] - base['final_val']) / base['final_val']:+.2f}%" \
                if base and r is not base else '—'
            rows.append([f"{r['model']} `{r['recipe']}{' ' + setup if setup else ''}`", f4(r['final_val']), delta,
                         bytes_per_param(r), memory(r), speed(r), where(r)])
    return table(['run (AdamW)', 'final val loss', 'vs fp32', 'persistent bytes/param', 'device memory (measured)',
                  'tokens/s', 'GPU, date, commit'], rows), spread


def main():
    head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()
    all_runs = [parse(p) for p in sorted(glob.glob(os.path.join(OUT, 'logs', '*', '*.log')))]
    def setup(r):
        return (r['study'], f"`{r['header'].get('commit', '?')}`", r['device'] or '—',
                r['model'] or '—', r['shape'] or '—')
    made = [setup(r) for r in all_runs if 'cmd' in r['header']]
    # the title names the model and shape most runs share: the series differ in those
    common = max(((m[3], m[4]) for m in made), key=[(m[3], m[4]) for m in made].count, default=('—', '—'))
    md = [f'# 8-bit and flash training against 32-bit: {common[0]}, {common[1]}\n',
          f"Generated by `dev/experiments/results.py` at commit {head or 'unknown'} on "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, from the logs in `{LINK}/logs/`; every number "
          'below is read from them (train_gpt2_8bit\'s output).\n']
    rows = [list(key) + [made.count(key)] for key in sorted(set(made))]
    md.append(table(['study', 'commit of the runs', 'device (the trainer\'s first line)', 'model', 'batch, steps',
                     'runs'], rows))
    diverged = [r['name'] for r in all_runs if status(r).startswith('**diverged')]
    md.append(f"\nDiverged runs (a non-finite loss, a skipped step, or a loss above its start): "
              f"{', '.join(f'`{n}`' for n in diverged) if diverged else 'none'}.\n")
    gone = missing()
    if gone is not None:
        md.append(f"Runs the study scripts list that have no complete log yet ({len(gone)}): "
                  f"{', '.join(f'`{g}`' for g in gone) if gone else 'none'}.\n")
    for study, title, fn in STUDIES:
        runs = runs_of(study)
        if not runs and not any(s == study for s, _, _ in queued() or []):
            continue
        md.append(f'\n## {title}\n')
        fn(md)
        key = lean_plot_order if study == 'study5_lean' else plot_order
        for png in sorted(glob.glob(os.path.join(OUT, 'plots', study + '_*.png')), key=key):
            md.append(f'\n![{os.path.basename(png)}]({LINK}/plots/{os.path.basename(png)})\n')
        md.append('')
        if runs:
            commands(md, study, runs)
    with open(PAGE, 'w') as f:
        f.write('\n'.join(md))
    print(f'{PAGE}: {len(all_runs)} logs, {len(diverged)} diverged')
    if README:
        t, spread = readme_table()
        print(t + (f"\nfp32 seed spread (study 3): {spread:.4f}" if spread is not None else ''))
        line = seeds_line('study4_scale')
        if line:
            print('study 4 over the seeds: ' + line)
        if gone:
            print('missing: ' + ', '.join(gone))
    if SUMMARY:
        print(f"{'run':44} {'val loss':>8} {'tokens/s':>9} {'B/param':>7} {'memory':>9}  status")
        for r in all_runs:
            print(f"{r['study'] + '/' + r['name']:44} {f4(r['final_val']):>8} {speed(r).replace(' (shared)', '*'):>9} "
                  f"{'—' if r['bpp'] is None else format(r['bpp'], '.3f'):>7} {memory(r):>9}  {status(r)[:60]}")


if __name__ == '__main__':
    main()
