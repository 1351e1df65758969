#!/usr/bin/env python3
"""The include graph of src/bmt: fails on a cycle between modules, an include that runs up the layers, an
`extern` re-declaration of another file's function, or more files reading the global `config()` than
CONFIG_READERS_MAX (code only: comments and string literals do not count).

A module is a file's stem without `_internal` (block.h, block.cpp and block_internal.h are one module). The layers,
bottom-up, are the folders below; a file may include its own folder and the folders under it, never one above
(docs/design.md, "Source layout"). Usage: scripts/check_includes.py [--graph] (prints the folder graph)."""
import os
import re
import sys
from collections import defaultdict

# Bottom-up; folders on one rank sit side by side and may not include each other both ways.
LAYERS = [['core'], ['runtime'], ['params'], ['engine'], ['nn', 'loss', 'optim', 'pipeline'], ['checkpoint'], ['']]
RANK = {folder: i for i, group in enumerate(LAYERS) for folder in group}
# Files whose code reads bmt::config() (docs/design.md, "Who reads config()"): the count may only go down; lower
# this when a reader goes, never raise it (pass the context as an argument instead).
CONFIG_READERS_MAX = 24
CONFIG_READ = re.compile(r'(?<![\w.>])config\(\)(?!\s*const\b)')
INCLUDE = re.compile(r'^\s*#\s*include\s+["<](bmt/[^">]+)[">]', re.M)
# A function declared in a .cpp but defined elsewhere (`extern` or a bare prototype at namespace scope) re-declares
# another file's symbol: the declaration belongs in that file's header.
EXTERN = re.compile(r'^\s*extern\s+(?!"C")[^;{]*\(', re.M)
PROTOTYPE = re.compile(r'^(?!return\b|using\b|typedef\b|static_assert\b|#)[A-Za-z_][\w:<>,*& ]*?[\s*&]'
                       r'([A-Za-z_]\w*)\s*\((?![\d"\'])[^;{}"]*\)\s*(?:const\s*)?(?:noexcept\s*)?;', re.M)


def defines(text, name):
    """True when `text` holds a body for function `name` (name(...) followed by '{' before any ';')."""
    for m in re.finditer(r'\b' + re.escape(name) + r'\s*\(', text):
        depth, i = 0, m.end() - 1
        while i < len(text):
            depth += text[i] == '('
            depth -= text[i] == ')'
            i += 1
            if depth == 0:
                break
        rest = text[i:i + 400]
        semi, brace = rest.find(';'), rest.find('{')
        if brace != -1 and (semi == -1 or brace < semi):
            return True
    return False


def reads_config(text):
    """True when code (not a comment or a string literal) in `text` calls config()."""
    text = re.sub(r'/\*.*?\*/', '', text, flags=re.S)
    for line in text.splitlines():
        code = re.sub(r'"(?:[^"\\]|\\.)*"', '""', line).split('//')[0]
        if CONFIG_READ.search(code):
            return True
    return False


def folder_of(rel):  # rel: path under src/bmt
    top = rel.split('/')[0] if '/' in rel else ''
    return top


def module_of(rel):
    stem = os.path.splitext(rel)[0]
    return stem[:-len('_internal')] if stem.endswith('_internal') else stem


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'src')
    files = []
    for d, _, names in os.walk(os.path.join(root, 'bmt')):
        files += [os.path.relpath(os.path.join(d, n), os.path.join(root, 'bmt')) for n in names
                  if n.endswith(('.h', '.cpp', '.cu', '.cuh'))]
    errors = []
    config_readers = []
    edges = defaultdict(set)        # module -> modules
    folder_edges = defaultdict(set)
    for rel in sorted(files):
        text = open(os.path.join(root, 'bmt', rel), encoding='utf-8').read()
        f = folder_of(rel)
        if reads_config(text):
            config_readers.append(rel)
        if f not in RANK:
            errors.append(f'src/bmt/{rel}: folder "{f}" is not a layer of scripts/check_includes.py (add it)')
            continue
        if rel.endswith(('.cpp', '.cu')):
            for m in EXTERN.finditer(text):
                errors.append(f'src/bmt/{rel}: extern re-declaration "{m.group(0).strip()}": include the header '
                              'that declares it')
            for m in PROTOTYPE.finditer(text):
                if not defines(text, m.group(1)):
                    errors.append(f'src/bmt/{rel}: declares {m.group(1)}(), defined in another file: include the '
                                  'header that declares it')
        for inc in INCLUDE.findall(text):
            target = inc[len('bmt/'):]
            if not os.path.exists(os.path.join(root, 'bmt', target)):
                errors.append(f'src/bmt/{rel}: includes {inc}, which does not exist')
                continue
            g = folder_of(target)
            if module_of(target) != module_of(rel):
                edges[module_of(rel)].add(module_of(target))
            if g != f:
                folder_edges[f].add(g)
                if RANK.get(g, -1) > RANK[f]:
                    errors.append(f'src/bmt/{rel}: includes {inc}, a layer above ("{g or "bmt"}" over '
                                  f'"{f or "bmt"}")')
    for f, gs in folder_edges.items():
        for g in gs:
            if f in folder_edges.get(g, ()) and f < g:
                errors.append(f'folders {f} and {g} include each other')
    # Cycles between modules (Tarjan's strongly connected components).
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    for comp in comps:
        pairs = [f'{a} <-> {b}' for a in comp for b in comp if a < b and b in edges[a] and a in edges[b]]
        errors.append('include cycle between modules: ' + ', '.join(comp) +
                      (f' (two-way: {"; ".join(pairs)})' if pairs else ''))
    if len(config_readers) > CONFIG_READERS_MAX:
        errors.append(f'{len(config_readers)} files read config(), more than CONFIG_READERS_MAX = '
                      f'{CONFIG_READERS_MAX}: take the context (communicator, stream, device, sizes) as an argument '
                      'instead (docs/design.md, "Who reads config()"); readers: ' +
                      ', '.join('src/bmt/' + r for r in config_readers))
    n_modules = len(set(edges) | {w for ws in edges.values() for w in ws})
    n_edges = sum(len(ws) for ws in edges.values())
    if '--graph' in sys.argv:
        for f in sorted(folder_edges, key=lambda x: RANK.get(x, 99)):
            print(f'{f or "bmt"} -> {", ".join(sorted(g or "bmt" for g in folder_edges[f]))}')
    for e in errors:
        print('check_includes:', e)
    print(f'check_includes: {len(files)} files, {n_modules} modules, {n_edges} module includes, '
          f'{len(comps)} cycles, {len(config_readers)} files reading config() (at most {CONFIG_READERS_MAX}), '
          f'{len(errors)} problems')
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main())
