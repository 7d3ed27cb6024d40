"""Mutation check of the objectives' tests: each one-line change to a formula in prl/trainer/loss.py,
prl/trainer/step.py (the step's divisor) or the schema's normalisation, applied to a copy of the tree, must make
tests/test_objectives.py fail. Run: .venv/bin/python tests/mutation_objectives.py [test files]; prints each
mutation and one JSON line ({"mutations": N, "survived": [...]}). About a minute a mutation on 2 cores."""
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
M = [
 ("loss", "return -ratio_of(b).clamp(max=cfg.tis_cap) * b.advantages * b.logp, b.mask", "return -ratio_of(b) * b.advantages * b.logp, b.mask"),
 ("loss", "return -ratio.clamp(max=cfg.tis_cap) * adv * b.logp, b.mask & ~past", "return -ratio * adv * b.logp, b.mask & ~past"),
 ("loss", "(ratio > 1 + cfg.clip_high)) | ((adv < 0) & (ratio < 1 - cfg.clip_low))", "(ratio > 1 + cfg.clip_low)) | ((adv < 0) & (ratio < 1 - cfg.clip_high))"),
 ("loss", "s.clamp(1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high)", "s.clamp(1 - cfg.gspo_clip_high, 1 + cfg.gspo_clip_low)"),
 ("loss", "clamp(min=1 - cfg.cispo_clip_low, max=1 + cfg.cispo_clip_high)", "clamp(max=1 + cfg.cispo_clip_high)"),
 ("loss", "seq_ratio = torch.exp(sequence_mean(b.logp.detach() - b.infer_logp, b))", "seq_ratio = ratio_of(b)"),
 ("loss", "        return -r\n", "        return r\n"),
 ("loss", "return 0.5 * r * r", "return r * r"),
 ("loss", "r = torch.where(mask, ref_logp - logp, 0)", "r = torch.where(mask, logp - ref_logp, 0)"),
 ("loss", "loss_L = loss_L + cfg.kl_coef * kl_L", "loss_L = loss_L - cfg.kl_coef * kl_L"),
 ("step", "return float(constant)", "return 2 * float(constant)"),
 ("step", 'if mode == "token" else sequences_with_loss', 'if mode == "token" else (lambda mb: float(mb.loss_tokens))'),
 ("loss", "loss_L = loss_L / sequence_tokens(b, loss_L.dtype)[b.sequence_ids]", "loss_L = loss_L"),
 ("loss", "loss_L = loss_L - cfg.entropy_coef *", "loss_L = loss_L + cfg.entropy_coef *"),
 ("loss", "(ratio >= cfg.mask_low) & (ratio <= cfg.mask_high)", "(ratio >= cfg.mask_low) & (ratio <= cfg.mask_low + 1)"),
 ("loss", "return (per_sample(values_L, b) / sequence_tokens(b, values_L.dtype))[b.sequence_ids]", "return per_sample(values_L, b)[b.sequence_ids]"),
 ("loss", "s = sequence_ratio(b.logp.detach() - b.infer_logp, b) * torch.exp(b.logp - b.logp.detach())", "s = sequence_ratio(b.logp - b.infer_logp, b) * torch.exp(b.logp - b.logp.detach())"),
 ("loss", "past = ((adv > 0) & (ratio > 1", "past = ((adv < 0) & (ratio > 1"),
 ("schema", 'if self.correction in ("gspo", "gspo_token") else "token"', 'if self.correction in ("gspo",) else "token"'),
 ("loss", "    return loss_L.sum(), stats", "    return loss_L[keep].sum(), stats"),
 ("loss", "e - r - 1 + (r - LOG_RATIO_BOUND)", "e + r - 1 + (r - LOG_RATIO_BOUND)"),
 ("loss", "clipped_surrogate(sequence_ratio(b.logp - b.infer_logp, b)", "clipped_surrogate(torch.exp(b.logp - b.infer_logp)"),
 ("loss", "-torch.minimum(s * adv,", "-torch.maximum(s * adv,"),
 ("loss", 'return -b.advantages * b.logp, b.mask\n', 'return -b.advantages * b.logp * 1.01, b.mask\n'),
]
FILES = {"loss": "prl/trainer/loss.py", "step": "prl/trainer/step.py", "schema": "prl/recipe/schema.py"}
src = Path(__file__).resolve().parents[1]


def applies(f: str, old: str) -> bool:
    return (src / FILES[f]).read_text().count(old) == 1


def main():
    tests = sys.argv[1:] or ["tests/test_objectives.py"]
    survived = []
    for i, (f, old, new) in enumerate(M):
        dst = Path(tempfile.mkdtemp(prefix=f"prl-mutant{i}-"))
        shutil.copytree(src / "prl", dst / "prl")
        shutil.copytree(src / "tests", dst / "tests")
        shutil.copy(src / "pyproject.toml", dst / "pyproject.toml")
        for d in ("recipes", "examples", "docs"):
            (dst / d).symlink_to(src / d)
        p = dst / FILES[f]
        t = p.read_text()
        assert t.count(old) == 1, (i, old, t.count(old))
        p.write_text(t.replace(old, new))
        r = subprocess.run([str(src / ".venv/bin/python"), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                           cwd=dst, env={"PYTHONPATH": str(dst), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
        caught = r.returncode != 0
        print(i, "caught" if caught else "SURVIVED", f, new[:70], flush=True)
        if not caught:
            survived.append(i)
        shutil.rmtree(dst)
    print(json.dumps({"mutations": len(M), "survived": survived}))


if __name__ == "__main__":
    main()
