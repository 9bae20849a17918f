"""Our autoencoder files against SAELens' own code (issue 42): SAELens' ``SAE.load_from_disk``
loads what ``TopKAutoencoder.save`` writes and computes the same features and reconstructions, and
what SAELens' ``save_model`` writes loads here. SAELens is optional (``pip install
'clover-lab[saelens]'``: it pulls TransformerLens and datasets), so this skips without it."""
import pytest
import torch

from clover_lab.features import TopKAutoencoder

pytestmark = pytest.mark.slow  # importing SAELens takes ~10 s (TransformerLens)
sae_lens = pytest.importorskip("sae_lens", reason="SAELens is not installed (pip install 'clover-lab[saelens]'); "
                                                  "the layout itself is tested in test_autoencoder.py")


def _ours() -> TopKAutoencoder:
    g = torch.Generator().manual_seed(0)
    sae = TopKAutoencoder(32, 96, 6, hook_name="layers.2.output", model_name="clover-stdlib")
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    sae.metadata["clover_lab"] = {"rows": "preview rows of every denoising step"}
    return sae


def test_saelens_loads_ours_and_agrees(tmp_path):
    ours = _ours()
    ours.save(tmp_path / "ours")
    theirs = sae_lens.SAE.load_from_disk(str(tmp_path / "ours"))
    assert type(theirs).__name__ == "TopKSAE" and theirs.cfg.k == 6 and theirs.cfg.d_sae == 96
    assert theirs.cfg.metadata.hook_name == "layers.2.output"
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(1)) * 5
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode(x), ours.encode(x))
        torch.testing.assert_close(theirs(x), ours(x))


def test_what_saelens_saves_loads_here(tmp_path):
    ours = _ours()
    ours.save(tmp_path / "ours")
    theirs = sae_lens.SAE.load_from_disk(str(tmp_path / "ours"))
    theirs.save_model(str(tmp_path / "theirs"))
    back = TopKAutoencoder.load(tmp_path / "theirs")
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(x), ours(x))
    assert back.metadata["sae_lens_version"] == "6.0.0" and back.hook_name == "layers.2.output"
