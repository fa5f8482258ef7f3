"""Reads one log written by common.sh's run: its '# key value' header, then the trainer's output.
Standard library only. The line formats are train_gpt2_8bit.c's printf formats."""
import math
import os
import re

# the norm may be followed by the clip rule's own norm ("(est a..b)", "(prev x)") and "clipped"
STEP = re.compile(r'^step\s+(\d+)/(\d+) \| loss (\S+) \| lr (\S+) \| norm\s+(\S+)([^|]*)\|')
VAL = re.compile(r'^step\s+(\d+) \| val loss (\S+)')
SPEED = re.compile(r'^speed\s+(\S+) tokens/s')
TOTAL = re.compile(r'= ([0-9.]+)\s*$')                           # "weights .. + optimizer state .. = X"
SCRATCH = re.compile(r'\): ([0-9.]+) bytes per parameter')     # release's gradient scratch, 2nd line
MODEL = re.compile(r'^model\s+(\S+): .*, (\d+) parameters, StableEmbedding (\w+)')
TRAIN = re.compile(r'^train\s+B=(\d+) T=(\d+)(, \d+ micro-batches per step)?, steps \d+\.\.\d+ of (\d+)')
RECIPE = re.compile(r'^recipe\s+(\S+): (.*)')
OPTIM = re.compile(r'^optim\s+(\S+), lr (\S+)')
MEASURED = re.compile(r'^\s+measured \(cudaMemGetInfo[^)]*\)\s+([0-9.]+) ([kMG]?B)')
UNIT = {'B': 1, 'kB': 1e3, 'MB': 1e6, 'GB': 1e9}


def num(s):
    try:
        return float(s)   # accepts nan, -nan, inf
    except ValueError:
        return math.nan


def parse(path):
    r = dict(path=path, name=os.path.basename(path)[:-4], study=os.path.basename(os.path.dirname(path)),
             header={}, flags={}, device=None, train=[], val=[], skipped_steps=0, speed=None, bpp=None,
             scratch=None, mem=None, model=None, shape=None, params=None, stable=None, recipe=None, recipe_about='', optim=None, lr=None,
             error=None, complete=False)
    with open(path, errors='replace') as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ''
        if line.startswith('# '):
            key, _, value = line[2:].partition(' ')
            r['header'][key.rstrip(':')] = value
        elif m := STEP.match(line):
            r['train'].append((int(m[1]), num(m[3])))
            r['steps'] = int(m[2])
        elif m := VAL.match(line):
            r['val'].append((int(m[1]), num(m[2])))
        elif line.startswith('bnb8 train_gpt2_8bit: ') and r['device'] is None:
            r['device'] = line[len('bnb8 train_gpt2_8bit: '):]
        elif m := MODEL.match(line):
            r['model'], r['params'], r['stable'] = m[1], int(m[2]), m[3]
        elif m := TRAIN.match(line):
            r['shape'] = f'B={m[1]} T={m[2]}{m[3] or ""}, {m[4]} steps'
        elif m := RECIPE.match(line):
            r['recipe'], r['recipe_about'] = m[1], m[2]
        elif m := OPTIM.match(line):
            r['optim'], r['lr'] = m[1], m[2]
        elif 'persistent bytes per parameter' in line and (m := TOTAL.search(nxt)):
            r['bpp'] = float(m[1])   # printed at the start and in the report: the last one is kept
        elif m := MEASURED.match(line):
            r['mem'] = float(m[1]) * UNIT[m[2]]   # device memory measured; the report's (last) one is kept
        elif 'gradient scratch under release' in line and (m := SCRATCH.search(nxt)):
            r['scratch'] = float(m[1])
        elif re.match(r'^step \d+: non-finite gradient norm', line):
            r['skipped_steps'] += 1
        elif m := SPEED.match(line):
            r['speed'], r['complete'] = float(m[1]), True
        elif line.startswith('error: ') and r['error'] is None:
            r['error'] = line
    words = r['header'].get('cmd', '').split()
    for j, w in enumerate(words[:-1]):
        if re.fullmatch(r'-[A-Za-z]', w):
            r['flags'][w] = words[j + 1]
    r['final_val'] = r['val'][-1][1] if r['val'] else None
    return r


def window(r):
    """Steps averaged for the train-loss curve and the divergence test: 2% of the run, at least 5."""
    return max(5, len(r['train']) // 50)


def mean(xs):
    return sum(xs) / len(xs)


def divergence(r):
    """Why the run counts as diverged ([] if it did not): a non-finite loss, a skipped step, a val
    loss above the one before training, or a train-loss window mean above the first window's."""
    why = []
    bad = [s for s, x in r['train'] + r['val'] if not math.isfinite(x)]
    if bad:
        why.append(f'non-finite loss at step {min(bad)}')
    if r['skipped_steps']:
        why.append(f"{r['skipped_steps']} steps skipped (non-finite gradient norm)")
    if r['val'] and r['val'][0][0] == 0:
        v0 = r['val'][0][1]
        above = [s for s, x in r['val'][1:] if x > v0]
        if above:
            why.append(f'val loss above its start {v0:.4f} at step {above[0]}')
    losses = [x for _, x in r['train'] if math.isfinite(x)]
    w = window(r)
    if len(losses) >= 2 * w:
        first = mean(losses[:w])
        for s in range(w, len(losses) - w + 1):
            if mean(losses[s:s + w]) > first:
                why.append(f'train loss (mean of {w} steps) above its start {first:.4f} from step {s + 1}')
                break
    return why


def worst_val_rise(r):
    """The largest rise of the val loss above its lowest value so far (0: it never rose)."""
    rise, low = 0.0, math.inf
    for _, x in r['val']:
        if math.isfinite(x):
            rise, low = max(rise, x - low), min(low, x)
    return rise


def worst_spike(r):
    """The largest train loss above the mean of the window of steps before it."""
    losses = [x for _, x in r['train'] if math.isfinite(x)]
    w = window(r)
    return max((losses[s] - mean(losses[s - w:s]) for s in range(w, len(losses))), default=0.0)
