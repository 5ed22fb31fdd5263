"""`nlq sample` (text from a trained model) and `nlq eval` (its log-loss on a split)."""

from __future__ import annotations

import sys
from pathlib import Path


def add_step_argument(p) -> None:
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the run's checkpoint of step N (default: its newest, which must "
                        "verify: an older one is never used in its place)")


def step_text(step: int | None) -> str:
    return "step unknown (a saved model folder)" if step is None else f"step {step}"


def add_sample_arguments(p) -> None:
    p.add_argument("model", metavar="RUN_DIR|CKPT",
                   help="a run dir, a checkpoint dir (RUN/ckpt/step_N) or a saved model folder")
    add_step_argument(p)
    p.add_argument("--prompt", default="", help="text to continue (default: none: the model "
                   "starts after an end-of-text token)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to add (default 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the likeliest tokens whose probability reaches p, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--num-samples", type=int, default=1, help="continuations (default 1)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the prepared data dir whose tokenizer to use (default: the run's)")
    p.add_argument("--no-stop", action="store_true",
                   help="do not stop at the end-of-text token")


def run_sample(args) -> int:
    import torch

    from nlq.errors import NlqError
    from nlq.infer.load import check_same_data, check_vocab, load_tokenizer, load_trained
    from nlq.model.generate import check_sampling

    check_sampling(args.temperature, args.top_k, args.top_p)  # before loading anything
    try:  # a byte the shell passed undecoded becomes a lone surrogate: no tokenizer takes it
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise NlqError(f"--prompt is not valid text: character {e.start} is not UTF-8 "
                       f"({args.prompt[e.start]!r}; check the terminal's encoding)") from None
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise NlqError("--max-new-tokens and --num-samples must be >= 1")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise NlqError(f"--seed must be in [0, 2**63), got {args.seed}")
    got = load_trained(args.model, args.step)
    model = got.model
    data = Path(args.data) if args.data else got.data
    if data is None:
        raise NlqError(f"{args.model} does not say which data it trained on: give --data DIR "
                       f"(a prepared data dir with the model's tokenizer)")
    if args.data:
        check_same_data(got.data, data, "its tokens would decode to other text")
    tok = load_tokenizer(data)
    check_vocab(model, tok, data)
    print(f"nlq: sampling {got.source}, {step_text(got.step)}", file=sys.stderr)
    ids = tok.encode([args.prompt])[0].tolist() if args.prompt else []
    prompt = [tok.eot_id] + ids  # as in training, where documents follow an end-of-text
    idx = torch.tensor([prompt] * args.num_samples, dtype=torch.long)  # (N, T0)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                         stop_token=None if args.no_stop else tok.eot_id)
    for i, row in enumerate(out.tolist()):
        new = row[len(prompt):]
        if not args.no_stop and tok.eot_id in new:
            new = new[:new.index(tok.eot_id)]
        if args.num_samples > 1:
            print(f"--- sample {i}", file=sys.stderr)
        print(args.prompt + tok.decode(new))
    return 0


def add_eval_arguments(p) -> None:
    p.add_argument("model", metavar="RUN_DIR|CKPT",
                   help="a run dir, a checkpoint dir (RUN/ckpt/step_N) or a saved model folder")
    add_step_argument(p)
    p.add_argument("--data", default=None, metavar="DIR",
                   help="a prepared data dir with the model's tokenizer (default: the run's)")
    p.add_argument("--split", default="test", choices=("test", "val", "train"),
                   help="the split scored, whole, document by document (default: test)")
    p.add_argument("--json", action="store_true", help="print one JSON object (per-document "
                   "nats and tokens included)")


def run_eval(args) -> int:
    import json

    from nlq.infer.evaluate import eval_model

    r = eval_model(args.model, args.data, args.split, step=args.step)
    if args.json:
        print(json.dumps(r))
        return 0
    lo, hi = r["ci95"]
    plo, phi = r["ppl_ci95"]
    print(f"{r['checkpoint']}, {step_text(r['step'])}")
    print(f"{r['split']} split of {r['data']}: {r['docs']:,} documents, {r['tokens']:,} tokens")
    print(f"log-loss {r['log_loss']:.4f} nats/token [95% CI over documents {lo:.4f}, {hi:.4f}]")
    print(f"perplexity {r['ppl']:.3f} [{plo:.3f}, {phi:.3f}]")
    return 0


def add_convert_arguments(p) -> None:
    p.add_argument("model", metavar="RUN_DIR|CKPT",
                   help="a run dir, a checkpoint dir or a saved model folder")
    add_step_argument(p)
    p.add_argument("--to", default="gpt2", choices=("gpt2", "hf"),
                   help="the format: gpt2, transformers' GPT2LMHeadModel (a linear decoder "
                        "only); hf, model_type 'nlq' (any arm; load it after `import nlq.hf`; "
                        "nlq eval and nlq sample read it too). Default gpt2")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the folder written: new, empty, or one `nlq convert` wrote before "
                        "(replaced whole); its nlq_convert.json names the source and step")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the data dir whose tokenizer goes with it (default: the run's)")


def run_convert(args) -> int:
    from nlq import __version__
    from nlq.hf.gpt2 import save_gpt2, save_tokenizer
    from nlq.infer import convert
    from nlq.infer.load import check_same_data, load_trained

    out = Path(args.out)
    convert.check_out(out)  # before loading anything
    got = load_trained(args.model, args.step)
    model = got.model
    data = Path(args.data) if args.data else got.data
    if args.data:  # asked for: it must be there, and be the model's tokenizer
        check_same_data(got.data, data, "its tokenizer is not the model's")
    with_tok = data is not None and (data / "meta.json").is_file()

    def fill(folder: Path) -> None:
        if args.to == "hf":
            from nlq.hf.auto import save_hf

            save_hf(model, folder)
        else:
            save_gpt2(model, folder)
        if with_tok:
            save_tokenizer(data, folder)

    convert.write(out, fill, {"format": args.to, "source": str(got.source.resolve()),
                              "step": got.step, "nlq_version": __version__})
    what = "model and tokenizer" if with_tok else "model"
    auto = "AutoModelForMaskedLM" if model.cfg.arch == "encoder" else "AutoModelForCausalLM"
    kind, first = ("an nlq", "after `import nlq.hf`, ") if args.to == "hf" else ("a GPT-2", "")
    print(f"wrote {out}: {kind} {what} of {got.source}, {step_text(got.step)}; "
          f"{first}transformers.{auto}.from_pretrained({str(out)!r}) loads it")
    return 0


COMMANDS = {"sample": ("text from a trained model (temperature, top-k, top-p, seed)",
                       add_sample_arguments, run_sample),
            "eval": (("a trained model's log-loss and perplexity on a whole split, with an "
                      "interval over documents"), add_eval_arguments, run_eval),
            "convert": (("write a model as a transformers folder with the same logits: GPT-2 "
                         "(a linear decoder) or model_type nlq (any arm)"),
                        add_convert_arguments, run_convert)}
