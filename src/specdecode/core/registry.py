"""The method registry: every speculative-decoding method, one entry each (issue 45 item 2).

An entry says what a method needs to load (a draft model, trained heads of its kind, layers to
skip, or nothing), which backends run it, what it drafts (chains, trees, or nothing), whether
the batch engine takes its rows, how a request of it is planned, and one line for the CLI's
help. Everything else reads these entries: ``config.METHODS``, ``TREE_METHODS``,
``DRAFT_MODEL_METHODS``, ``engine/batch_rows.BATCH_METHODS`` and the planners' table are views
derived here, kept under their old names for the code that imports them. Code that must single
out one method (the engine's plain k = 0 case, the drafters a decoder builds) names it through
its entry (``registry.LAYERSKIP.name``), not a string; tests/test_method_registry.py fails on a
method name written anywhere else.

Where it lives, and why it is plain data: ``config/decoder.py`` validates ``DecoderConfig.method``
against the registry, and nearly every package imports ``config``. So the registry sits on the
ground floor (``core/``, below config) and imports nothing of specdecode. The plan functions
themselves, which build drafters, stay in ``drafters/planner.py``, keyed by an entry's
``planner`` kind; the backend names are ``backends/base.py``'s, written out here (the registry
test checks they agree).

Adding a method: its drafter module under ``drafters/``, its entry below (a planner kind that
exists, or a plan function added to ``planner.py`` beside its kind), and its section in
docs/methods.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a method needs loaded.
NEEDS_NOTHING = "nothing"
NEEDS_DRAFT_MODEL = "a draft model"
USES_DRAFT_MODEL = "a draft model where one is loaded"  # runs without one, on its other sources
NEEDS_HEADS = "trained heads of its kind"  # `specdecode train NAME`; a heads file's kind is the method's name
NEEDS_SKIP_LAYERS = "layers to skip"  # skip_layers= or a `specdecode tune-layerskip` file
NEEDS = (NEEDS_NOTHING, NEEDS_DRAFT_MODEL, USES_DRAFT_MODEL, NEEDS_HEADS, NEEDS_SKIP_LAYERS)

# Which backends run it (backends/base.py's BACKENDS).
TORCH = "torch"
LLAMACPP = "llama.cpp"
BACKENDS = (TORCH, LLAMACPP)
ANY_BACKEND = BACKENDS
TORCH_ONLY = (TORCH,)  # needs the torch model itself: tree attention, hidden states, skipped layers

# What it drafts each step.
DRAFTS_NOTHING = "nothing"  # plain decoding: the k = 0 case
CHAINS = "chains"
TREES = "trees"  # verified with tree attention
TREES_WHERE_SCORED = "trees where the backend scores them, else its best chain"
DRAFT_SHAPES = (DRAFTS_NOTHING, CHAINS, TREES, TREES_WHERE_SCORED)

# How a request of it is planned (``drafters/planner.py`` holds a function per kind).
PLAN_PLAIN = "plain"
PLAN_CHAIN = "a stateless chain drafter"
PLAN_TREE = "a stateless tree drafter"
PLAN_SUFFIX = "a fresh suffix drafter"
PLAN_SOURCES = "a fresh drafter that picks its source every step"
PLANNER_KINDS = (PLAN_PLAIN, PLAN_CHAIN, PLAN_TREE, PLAN_SUFFIX, PLAN_SOURCES)


@dataclass(frozen=True, slots=True)
class Method:
    """One speculative-decoding method."""

    name: str  # as --method and method= spell it
    needs: str  # one of NEEDS
    backends: tuple[str, ...]  # ANY_BACKEND or TORCH_ONLY
    drafts: str  # one of DRAFT_SHAPES
    batch: bool  # the batch engine takes its rows (engine/batch_rows.py)
    planner: str  # one of PLANNER_KINDS
    description: str  # one line, for --help

    @property
    def uses_draft_model(self) -> bool:
        return self.needs in (NEEDS_DRAFT_MODEL, USES_DRAFT_MODEL)

    @property
    def needs_heads(self) -> bool:
        return self.needs == NEEDS_HEADS

    @property
    def uses_suffix_cache(self) -> bool:
        """Its requests draft from the decoder's cache of earlier responses (suffix trees)."""
        return self.planner in (PLAN_SUFFIX, PLAN_SOURCES)

    @property
    def model_free(self) -> bool:
        """Drafting costs no model pass (a lookup in the request's own text)."""
        return self.needs == NEEDS_NOTHING and self.drafts != DRAFTS_NOTHING


DRAFT = Method("draft", NEEDS_DRAFT_MODEL, ANY_BACKEND, CHAINS, True, PLAN_CHAIN,
               "a draft model proposes")
NONE = Method("none", NEEDS_NOTHING, ANY_BACKEND, DRAFTS_NOTHING, True, PLAN_PLAIN,
              "plain decoding")
NGRAM = Method("ngram", NEEDS_NOTHING, ANY_BACKEND, CHAINS, True, PLAN_CHAIN,
               "prompt lookup proposes (no draft model)")
AUTO = Method("auto", USES_DRAFT_MODEL, ANY_BACKEND, CHAINS, True, PLAN_SOURCES,
              "each step, lookup, suffix trees, draft model or plain decoding, whichever pays by measured cost and acceptance")
LAYERSKIP = Method("layerskip", NEEDS_SKIP_LAYERS, TORCH_ONLY, CHAINS, True, PLAN_CHAIN,
                   "the target drafts with layers skipped")
MEDUSA = Method("medusa", NEEDS_HEADS, TORCH_ONLY, TREES, True, PLAN_TREE,
                "trained Medusa heads (--heads) draft a token tree")
EAGLE = Method("eagle", NEEDS_HEADS, TORCH_ONLY, TREES, True, PLAN_TREE,
               "a trained EAGLE head (--heads) drafts a token tree")
SUFFIX = Method("suffix", NEEDS_NOTHING, ANY_BACKEND, TREES_WHERE_SCORED, True, PLAN_SUFFIX,
                "token trees from the text so far and earlier responses (no model)")

# In the order --help and error messages list them.
REGISTRY: tuple[Method, ...] = (DRAFT, NONE, NGRAM, AUTO, LAYERSKIP, MEDUSA, EAGLE, SUFFIX)
BY_NAME: dict[str, Method] = {method.name: method for method in REGISTRY}

# Views, by name.
METHODS: tuple[str, ...] = tuple(BY_NAME)
HEAD_METHODS: tuple[str, ...] = tuple(m.name for m in REGISTRY if m.needs_heads)
DRAFT_MODEL_METHODS: tuple[str, ...] = tuple(m.name for m in REGISTRY if m.uses_draft_model)
TORCH_ONLY_METHODS: tuple[str, ...] = tuple(m.name for m in REGISTRY if m.backends == TORCH_ONLY)
BATCH_METHODS: tuple[str, ...] = tuple(m.name for m in REGISTRY if m.batch)


def methods_help() -> str:
    """One line per method, for a ``--method`` flag's help."""
    return "; ".join(f"{m.name}: {m.description}" for m in REGISTRY)
