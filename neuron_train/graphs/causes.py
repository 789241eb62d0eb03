"""A checker cause's one home: the `CAUSES` table. Each cause has its name as the report prints it, its
own fix, the fixes for it at library lines (the library line alone is not actionable), the fixes for
the CPU fallback ops that make it, and the host-read kinds that are it when they run a graph before
the step's sync (with the torch.Tensor methods the hooks wrap for them). docs/architecture.md says
how to add one.
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_train.graphs import hlo_diff

WARMUP = "warm-up"  # a graph's kind of cause until its call site repeats one: no finding, so not in the table
NEW_CALL_SITE = "new call site"
HOST_ACCESS = "host access before sync"
VALUE_BRANCH = "value-dependent control flow"
DATA_DEPENDENT = "data-dependent shape"
HOST_READ = "host read after the sync"       # a copy that waits for the device; no extra graph
COMPILED_READ = "host access inside torch.compile"  # a read in a compiled call: a graph break, a wait mid-step
NEW_INPUT_SHAPE = hlo_diff.NEW_INPUT_SHAPE
NEW_CONSTANT = hlo_diff.NEW_CONSTANT
GRAPH_STRUCTURE = hlo_diff.GRAPH_STRUCTURE
SLICE_OFFSET = hlo_diff.SLICE_OFFSET
UNKNOWN = hlo_diff.UNKNOWN
DYNAMO_RECOMPILE = "dynamo recompilation"    # a guard of a torch.compile'd function failed
DYNAMO_EAGER = "dynamo fell back to eager"   # recompile limit reached: the function runs op by op
GRAPH_BREAK = "graph break"                  # torch.compile split a function (reported, not a defect)
PYTHON_BRANCH = "Python branch"              # a Python `if` chose which ops a step traced
SLICE_SHAPE = "slice-made shape"             # a slice with a computed length made an input's shape
GROWING_CONCAT = "tensor grown by concatenation"  # torch.cat onto the last run's result: a new length each run
GROWING_GRAPH = "graph grows every step"     # no sync ends the step: each graph holds every step before it
FSDP_AFTER_EVAL = "one-time graph after evaluation"  # torch_xla FSDP: parameters an evaluation left gathered
ACCUMULATION_REMAINDER = "gradient-accumulation remainder"  # an epoch's last window has fewer micro-batches
INFERENCE_MODE = "inference mode on an XLA device"  # torch_xla cannot run every model under it
MARK_DYNAMIC = "mark_dynamic under XLA"      # dynamo refuses a mark XLA specializes (one graph per shape)


@dataclass(frozen=True)
class ReadKind:
    """A kind of host read the hooks record (`HostRead.kind`)."""

    kind: str                      # "item"
    what: str                      # how the report names it: ".item()"
    methods: tuple[str, ...] = ()  # the torch.Tensor methods the hooks wrap for it ("" for reads only the log sees)


@dataclass(frozen=True)
class LibraryFix:
    """A fix the user can apply from their own code for a finding of its cause at a library line. Each is
    applied to a registry-package fixture and shown to remove its finding (tests/graphs/test_library_fixes.py);
    the first matching one wins."""

    library: str                 # package-relative file, or a folder ending in "/"
    fix: str
    function: str = ""           # only for a read in this library function ("": any)
    padded: bool | None = None   # only when a bool() read answered False (True) or never did (False)

    def matches(self, library: str, padded: bool, function: str) -> bool:
        return library.startswith(self.library) and self.function in ("", function) and self.padded in (None, padded)


@dataclass(frozen=True)
class Setting:
    """A library setting whose value makes the findings of its cause, named by a rule that recognizes it
    (graphs/hostsync.py for the Trainer's `logging_steps`): the finding keeps the value in the field of this
    name, and the report says the setting and gives its fix, both with that value."""

    name: str      # the setting: "logging_steps" (its value: the finding's field of that name, HostSync's)
    library: str   # the library whose reads it makes (a package-relative prefix)
    problem: str   # what the problem line adds: {value} the setting's value
    fix: str       # the fix for it, replacing the cause's own: {value} the setting's value


@dataclass(frozen=True)
class Cause:
    name: str                                    # as the report prints it (Graph.cause, HostSync.cause)
    fix: str                                     # its own fix, when nothing more precise is known
    library_fixes: tuple[LibraryFix, ...] = ()
    op_fixes: tuple[tuple[str, str], ...] = ()   # (CPU fallback op, the fixed-length way to its values)
    reads: tuple[ReadKind, ...] = ()             # host reads that are this cause when they run a graph
    settings: tuple[Setting, ...] = ()           # library settings that make it
    error: str = ""      # the text of an uncaught error that is this cause (the hooks' excepthook matches it)
    problem: str = ""    # that error's problem line: {where} the user's line that led to it, {error} the text


HOST_MIXUP = ("timm's Mixup/CutMix on device tensors draws a new box (and mixing factor) every batch, so every "
              "batch is a new graph: apply Mixup/CutMix on the host, in the data loader (the DataLoader's "
              "collate_fn, e.g. timm's FastCollateMixup), or `neuron-train train --mixup/--cutmix`, which "
              "mixes on the host; the device then gets one batch shape and soft targets as data")

EAGER = ("load the model with attn_implementation=\"eager\" (from_pretrained(..., attn_implementation=\"eager\"), "
         "or the config's), whose mask is built without reading it")

# transformers 5.24 asks `padding_mask.all()` (an encoder's bidirectional mask) or whether the padding mask is
# all ones (a causal model's, with sdpa), and without a mask checks a causal model's position ids for packed
# sequences: which change removes the read depends on the function that read.
MASKING = (
    LibraryFix("transformers/masking_utils.py", function="_ignore_bidirectional_mask_sdpa", padded=False,
               fix="transformers asks `padding_mask.all()` in every forward to skip the mask when nothing is "
               "padded; with fixed-length, unpadded batches leave `attention_mask` out of the batch (your dataset "
               "or collator): the model then builds no mask and reads nothing"),
    # Padded batches (the read answered False): a 4D bool mask gives BERT's sdpa the same outputs, no read.
    LibraryFix("transformers/masking_utils.py", function="_ignore_bidirectional_mask_sdpa", padded=True,
               fix="transformers asks `padding_mask.all()` in every forward to skip the mask when nothing is "
               "padded; these batches are padded (the mask it read has zeros), so keep `attention_mask` (leaving "
               "it out would attend to the padding): hand the model a prepared 4D mask, which masking_utils uses "
               "as is without reading it (attention_mask[:, None, None, :].bool() for the sdpa attention), in "
               "your collator or before the forward"),
    LibraryFix("transformers/masking_utils.py", function="_ignore_causal_mask_sdpa",
               fix="transformers asks whether the padding mask is all ones in every forward of a causal model with "
               "sdpa attention (to let sdpa apply causality without a mask): keep `attention_mask` and " + EAGER
               + "; leaving `attention_mask` out only moves the read (to a check of the position ids for packed "
               "sequences)"),
    LibraryFix("transformers/masking_utils.py", function="find_packed_sequence_indices",
               fix="without an `attention_mask` transformers checks a causal model's position ids for packed "
               "sequences in every forward: pass `attention_mask` (all ones when nothing is padded) and " + EAGER
               + " (with sdpa attention the mask itself is read instead)"),
)

CAUSES = (
    Cause(NEW_CALL_SITE, "precompile must run this code path too (e.g. an evaluation in the precompile run)"),
    Cause(HOST_ACCESS, "read values after the step's sync, in xm.add_step_closure(...)", reads=(
        ReadKind("item", ".item()", ("item",)), ReadKind("print", "printing a tensor", ("__repr__", "__format__")),
        ReadKind("tolist", ".tolist()", ("tolist",)), ReadKind("cpu", ".cpu()", ("cpu",)),
        ReadKind("numpy", ".numpy()", ("numpy",)), ReadKind("float", "float()", ("__float__",)),
        ReadKind("int", "int()", ("__int__",)), ReadKind("value", "a tensor value read")), settings=(
        Setting("logging_steps", "transformers/trainer",
                problem="the Trainer's loss log, TrainingArguments(logging_steps={value})",
                fix="TrainingArguments(logging_steps={value}) makes the Trainer read the loss (.item()) every "
                    "{value} optimizer steps: each read runs the pending step as a graph of its own and waits for "
                    "the device before the step's sync, 1 in {value} steps; raise logging_steps (a read every 3 or "
                    "more optimizer steps is reported, not a failure; the default is 500)"),)),
    Cause(VALUE_BRANCH, "compute both branches and pick with torch.where instead of a Python `if` on a tensor",
          library_fixes=MASKING, reads=(ReadKind("bool", "Python if/bool() on a tensor", ("__bool__",)),)),
    Cause(DATA_DEPENDENT, "keep shapes static: mask (torch.where, multiply by a 0/1 mask) instead of "
                          "nonzero() or boolean indexing",
          reads=(ReadKind("fallback", "a CPU fallback op"),),
          op_fixes=(("aten::_unique2",
                     "count with a fixed length: torch.nn.functional.one_hot(labels, num_classes).sum(0) counts "
                     "every class (0 for one a batch lacks), where torch.unique(..., return_counts=True) returns "
                     "only the classes present, a length that depends on the data (and runs on the CPU)"),)),
    Cause(NEW_INPUT_SHAPE, "give every batch the same shape: drop_last=True, or pad/bucket to fixed sizes", (
        LibraryFix("transformers/trainer.py",
                   "TrainingArguments(dataloader_drop_last=True) for a ragged last batch; for varying lengths pad "
                   "every batch to one length (a collator with padding=\"max_length\", or pad_to_multiple_of for a "
                   "few buckets)"),
        LibraryFix("transformers/data/data_collator.py",
                   "the collator pads each batch to its own longest sample (dynamic padding: a new length, so a new "
                   "graph, per batch): DataCollatorWithPadding(tokenizer, padding=\"max_length\", max_length=N) for "
                   "one length, or pad_to_multiple_of=M for a few (each compiled once: precompile them)"),
        LibraryFix("accelerate/", "drop_last=True on the DataLoader you hand to accelerator.prepare (accelerate "
                                  "keeps it), or pad/bucket to fixed sizes"))),
    Cause(NEW_CONSTANT, "avoid the exact values 0 and 1 for Python scalars that change (start a warm-up "
                        "above 0, or pass the value as a device tensor)",
          # an unmixed batch (prob < 1) has a mixing factor of exactly 1, baked into mixup_target's graph
          (LibraryFix("timm/data/mixup.py", HOST_MIXUP),)),
    Cause(GRAPH_STRUCTURE, "make slice and loop lengths fixed (pad to the maximum length and mask)"),
    Cause(HOST_READ, "fine once in a while; in every step, move it into xm.add_step_closure(...)"),
    Cause(COMPILED_READ, "return the tensor from the compiled function and read it after the call's sync "
                         "(torch_xla.sync(), or in xm.add_step_closure(...)): inside the compiled step the read "
                         "breaks its graph in two and waits for the device mid-step"),
    Cause(UNKNOWN, "no difference the checker reads (input shapes, constants, ops, slice bounds) tells the two "
                   "graphs apart: torch_xla's hash also covers what the HLO text leaves out (input layouts and "
                   "shardings, donated buffers); diff the two graphs' HLO (XLA_FLAGS=--xla_dump_to=DIR, "
                   "*.before_optimizations.txt of the two hashes) and keep whatever differs the same every step"),
    Cause(FSDP_AFTER_EVAL, "nothing to change in the script: one more training graph, compiled once and run again "
                           "after every evaluation; precompile covers it when its tour runs a training step after "
                           "the first evaluation: a DataLoader-fed loop's default tour does (past the first epoch's "
                           "end), else raise --steps past the first evaluation (precompile names the --steps that "
                           "reach it)"),
    Cause(SLICE_OFFSET, "slice on the host: keep the data on the CPU and move each batch to the device "
                        "(`source[i:i + n].to(device)`): one graph for every offset; a slice of a device tensor "
                        "at a Python offset bakes the offset into the step's graph"),
    Cause(DYNAMO_RECOMPILE, "keep what the failed guard checks constant: pass a changing Python number as a "
                            "tensor (e.g. the optimizer's lr=torch.tensor(0.01)), give every batch one shape", (
        LibraryFix("torch/optim/",
                   "dynamo guards on the optimizer's Python hyperparameters: a scheduler that changes a float LR "
                   "recompiles the optimizer step every step; create the optimizer with lr=torch.tensor(LR) "
                   "(the scheduler then updates the tensor in place)"),)),
    Cause(DYNAMO_EAGER, "remove the recompilations above; raising torch._dynamo.config.recompile_limit only "
                        "compiles more graphs"),
    Cause(PYTHON_BRANCH, "make the choice on the device (torch.where, or multiply by a 0/1 mask) so one graph "
                         "serves every path, or keep the branch out of the traced step (sync before it; for an "
                         "accumulation remainder, sync every micro-batch or give every window the same length)"),
    Cause(SLICE_SHAPE, "cut to a few fixed lengths (buckets, each compiled once and precompiled) or pad to one "
                       "fixed length and mask the padding", (LibraryFix("timm/data/mixup.py", HOST_MIXUP),)),
    Cause(GROWING_CONCAT, "collect per-step results without growing a device tensor: append each one to a "
                          "Python list and torch.cat once after the loop, or move each to the CPU after the step's "
                          "sync (in xm.add_step_closure)", (
        LibraryFix("transformers/trainer_pt_utils.py",
                   "the Trainer's evaluation loop concatenates every eval batch's losses, logits and labels onto "
                   "the last ones on the device (a new length, so a new graph, per batch): TrainingArguments("
                   "eval_accumulation_steps=1) moves each batch's results to the CPU after its step and "
                   "concatenates there; prediction_loss_only=True does not help (the losses are still "
                   "concatenated)"),)),
    Cause(GROWING_GRAPH, "end every step with a sync: torch_xla.sync() (or xm.mark_step()) right after the "
                         "optimizer step, or iterate the loader through torch_xla's MpDeviceLoader, which syncs at "
                         "each step's end"),
    Cause(ACCUMULATION_REMAINDER, "make the batches per epoch a multiple of gradient_accumulation_steps (the "
                                  "dataset's size, the batch size or gradient_accumulation_steps), or accept the "
                                  "one extra step graph (compiled once, run every epoch) and precompile it"),
    Cause(GRAPH_BREAK, "fine when it is outside the step's hot path; torch._dynamo.explain(fn)(*args) lists them"),
    Cause(INFERENCE_MODE, "use torch.no_grad() there", error="Cannot set version_counter for inference tensor",
          problem="torch.inference_mode() at {where} on an XLA device: torch_xla cannot run this model under it "
                  "({error})"),
    Cause(MARK_DYNAMIC, "remove mark_dynamic there and give every batch one shape (drop_last=True, or pad/bucket "
                        "to fixed sizes)",
          error="as dynamic but your code specialized it",  # in dynamo's ConstraintViolationError
          problem="torch._dynamo.mark_dynamic at {where}: torch_xla compiles one graph per shape, so dynamo "
                  "specialized the marked dimension and refused the mark (ConstraintViolationError)"),
)

# Views of the table as imported, for the tests that run over every entry (tests/graphs/test_library_fixes.py).
FIXES = {cause.name: cause.fix for cause in CAUSES}  # each cause's own fix, by name
LIBRARY_FIXES = tuple((cause.name, entry) for cause in CAUSES for entry in cause.library_fixes)
FALLBACK_FIXES = {op: fix for cause in CAUSES for op, fix in cause.op_fixes}


@dataclass(frozen=True)
class _Views:
    """The lookups the checker makes in one table (`_views`)."""

    table: tuple[Cause, ...]
    by_name: dict[str, Cause]
    reads: dict[str, tuple[ReadKind, str]]  # read kind -> (its entry, its cause's name)


_BUILT: list[_Views] = []  # the views of the table last looked up


def _views() -> _Views:
    """Every lookup reads `CAUSES` when it runs, so a table extended later (a test plants an entry) is the
    one every lookup, and the hooks installed after it, use; its views are built once per table."""
    if not _BUILT or _BUILT[0].table is not CAUSES:
        _BUILT[:] = [_Views(CAUSES, {cause.name: cause for cause in CAUSES},
                            {read.kind: (read, cause.name) for cause in CAUSES for read in cause.reads})]
    return _BUILT[0]


def tensor_reads() -> dict[str, str]:
    """torch.Tensor method -> the kind of host read it is: what the hooks wrap."""
    return {method: read.kind for cause in CAUSES for read in cause.reads for method in read.methods}


def errors() -> tuple[Cause, ...]:
    """The causes with an `error`: what the hooks' excepthook looks for."""
    return tuple(cause for cause in CAUSES if cause.error)


def own_fix(cause: str) -> str:
    """The cause's own fix (the unknown cause's for a name the table lacks)."""
    by_name = _views().by_name
    return (by_name[cause] if cause in by_name else by_name[UNKNOWN]).fix


def fix_for(cause: str, library: str, padded: bool = False, function: str = "") -> str:
    """The fix for a finding: the library-aware one when the library line matches a known pattern
    (`padded`: the library's bool() read answered False; `function`: the library function that read)."""
    by_name = _views().by_name
    known = by_name[cause].library_fixes if cause in by_name else ()
    entry = next((e for e in known if e.matches(library, padded, function)), None)
    return entry.fix if entry is not None else own_fix(cause)


def fallback_fix(op: str) -> str:
    """The fix for a CPU fallback op that makes its cause, "" for an op the table has none for."""
    return next((fix for cause in CAUSES for known, fix in cause.op_fixes if known == op), "")


def read_cause(kind: str | None) -> str:
    """The cause of a host read of this kind that runs a graph before the step's sync."""
    reads = _views().reads
    return reads[kind][1] if kind is not None and kind in reads else HOST_ACCESS


def read_what(kind: str) -> str:
    """How the report names a host read of this kind (".item()")."""
    return _views().reads[kind][0].what


def setting(name: str) -> Setting:
    """The library setting of this name (a rule that recognizes it fills its value into the finding)."""
    return next(entry for cause in CAUSES for entry in cause.settings if entry.name == name)


def error_problem(cause: str, where: str) -> str:
    """The problem line of a known error the run ended with, at the user's line shown as `where`."""
    known = _views().by_name[cause]
    return f"{known.problem.format(where=where, error=known.error)}; fix: {known.fix}"
