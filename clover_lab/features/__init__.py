"""Sparse autoencoders on the denoising axis: the residual stream collected from real generations
(every preview, every step, masked and unmasked positions), a TopK autoencoder trained on it and
kept in SAELens' layout, the trunk's formats read (Qwen-Scope's TopK files; SAELens' JumpReLU
autoencoders and transcoders), reconstruction measured on held-out generations, features followed
per (block, step, position), and a feature's dashboard over a corpus.

    acts = features.collect(engine, prompts, layer=2, max_new_tokens=64)
    sae = features.train(acts, d_sae=2048, k=32, seconds=120)
    report, held = features.evaluate(engine, sae, heldout_prompts, max_new_tokens=64)   # FVU, loss change
    sae.save("runs/sae"); features.load("runs/sae")                     # SAELens' cfg.json + weights
    features.load("SAE-Res-Qwen3.5-35B-A3B-Base-W32K-L0_50/layer20.sae.pt")   # Qwen-Scope's files
    tl = features.timeline(engine, sae, prompt)                         # per (block, step, position)
    features.unmasking_order(held, sae).early(5)                        # features tied to early unmasking
    features.dashboard(acts, sae, 117, engine=engine)                   # top contexts, density, logit effect
"""
from clover_lab.features.activations import Activations, collect
from clover_lab.features.autoencoder import JumpReLUAutoencoder, SparseAutoencoder, TopKAutoencoder, Transcoder
from clover_lab.features.files import load
from clover_lab.features.profile import Context, FeatureDashboard, dashboard, logit_effect
from clover_lab.features.qwen_scope import load_qwen_scope, save_qwen_scope
from clover_lab.features.reconstruction import Reconstruction, concat, evaluate
from clover_lab.features.saelens import AutoencoderFileError
from clover_lab.features.timeline import FeatureTimeline, Frame, timeline, timeline_of
from clover_lab.features.training import TrainingLog, train
from clover_lab.features.unmasking import OrderFeature, UnmaskingOrder, unmasking_order

__all__ = ["Activations", "collect", "SparseAutoencoder", "TopKAutoencoder", "load", "Context", "FeatureDashboard",
           "dashboard", "logit_effect", "JumpReLUAutoencoder",
           "load_qwen_scope", "save_qwen_scope", "Transcoder", "Reconstruction", "concat", "evaluate",
           "AutoencoderFileError", "FeatureTimeline", "Frame", "timeline", "timeline_of", "TrainingLog", "train", "OrderFeature",
           "UnmaskingOrder", "unmasking_order"]
