"""Parts that model families are composed from (issue 35, DESIGN "The family contract").

A family is parts + presets + checkpoint names: it subclasses the parts it is made of and
registers itself; it never subclasses or imports the private names of a sibling family
(``packages/lmms-models/tests/test_family_parts.py`` checks). The parts:

* :mod:`.qwen3_vision`: the Qwen3-VL layout (Qwen3 decoder with interleaved mRoPE, the ViT with
  learned position embeddings and deepstack at host positions; :mod:`.qwen3_deepstack_sp`: its
  sequence-parallel TP style);
* :mod:`.qwen2_5_vision`: the Qwen2.5-VL windowed ViT (host-precomputed windows) on a Qwen2 decoder;
* :mod:`.omni_audio`: the Omni thinker's audio tower, TMRoPE positions and the two-tower order;
* :mod:`.qwen3_5_hybrid`: the Qwen3.5 hybrid decoder (Gated DeltaNet + gated softmax layers);
* :mod:`.omni_audio`: (above) with :mod:`.omni_checkpoint`, the released full-Omni folder layout;
* :mod:`.audio_lm`: an audio encoder + projector + text decoder (Qwen2-Audio's layout, Aero);
* :mod:`.text`: the Qwen2 decoder part, the tiny text config, the empty prepared mask;
* :mod:`.latent`: the 2-D sin-cos position table and VAE latent encoding (SiT, BAGEL).

Generic parts live beside them in the package root: ``_vl`` (Qwen-VL media merge), ``_audio``,
``_moe`` (the MoE mixin), ``_linear_spec`` (hybrid linear attention), ``_diffusion``.
"""
