"""Builders of thirty-four transformers families nobody on this project wrote, as a new user
would write them (small configs, random weights, the model computing its loss where it can),
for ``offload profile FILE:FN``.  The twenty-eighth session's rows in
``experiments/results/README.md`` came from each of them, one thread, eager::

    offload profile experiments/new_user_models.py:bart --batch 2 -o c.json
    offload solve c.json --recompute --budget 50% -o s.json      # 60-100% where the floor is higher
    offload train experiments/new_user_models.py:bart --chain c.json --schedule s.json --check-grads --op-memory

Each function takes the batch size and returns the model and its keyword batch.
"""
import torch
import transformers as T

def _ids(b, s, v=100):
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, v, (b, s), generator=g)

def _lm(model_cls, cfg, batch):
    """The model built under seed 0, and 16 token ids that are their own labels."""
    torch.manual_seed(0)
    x = _ids(batch, 16)
    return model_cls(cfg), {"input_ids": x, "labels": x}

def _small(cfg_cls, **kw):
    base = dict(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128)
    base.update(kw)
    return cfg_cls(**base)

def bart(batch):
    torch.manual_seed(0)
    cfg = T.BartConfig(vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                       use_cache=False, dropout=0.1)
    m = T.BartForConditionalGeneration(cfg)
    return m, {"input_ids": _ids(batch, 16), "labels": _ids(batch, 12)}

def marian(batch):
    torch.manual_seed(0)
    cfg = T.MarianConfig(vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                         use_cache=False, pad_token_id=1, decoder_start_token_id=1)
    return T.MarianMTModel(cfg), {"input_ids": _ids(batch, 16), "labels": _ids(batch, 12)}

def prophetnet(batch):
    torch.manual_seed(0)
    cfg = T.ProphetNetConfig(vocab_size=100, hidden_size=64, encoder_ffn_dim=128, decoder_ffn_dim=128, num_encoder_layers=2,
                             num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4,
                             max_position_embeddings=64, use_cache=False, ngram=2)
    return T.ProphetNetForConditionalGeneration(cfg), {"input_ids": _ids(batch, 16), "labels": _ids(batch, 12)}

def bloom(batch):
    cfg = T.BloomConfig(vocab_size=100, hidden_size=64, n_layer=3, n_head=4, use_cache=False, hidden_dropout=0.1,
                        attention_dropout=0.1)
    return _lm(T.BloomForCausalLM, cfg, batch)

def opt(batch):
    cfg = T.OPTConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, ffn_dim=128,
                      word_embed_proj_dim=32, max_position_embeddings=64, use_cache=False, dropout=0.1, layerdrop=0.0)
    return _lm(T.OPTForCausalLM, cfg, batch)

def xglm(batch):
    cfg = T.XGLMConfig(vocab_size=100, d_model=64, num_layers=3, attention_heads=4, ffn_dim=128,
                       max_position_embeddings=64, use_cache=False, dropout=0.1)
    return _lm(T.XGLMForCausalLM, cfg, batch)

def mistral(batch):
    cfg = _small(T.MistralConfig, num_key_value_heads=2, sliding_window=8, use_cache=False, attention_dropout=0.1)
    return _lm(T.MistralForCausalLM, cfg, batch)


def olmo2(batch):
    cfg = _small(T.Olmo2Config, use_cache=False)
    return _lm(T.Olmo2ForCausalLM, cfg, batch)


def persimmon(batch):
    cfg = _small(T.PersimmonConfig, use_cache=False, qk_layernorm=True, hidden_dropout=0.1)
    return _lm(T.PersimmonForCausalLM, cfg, batch)

def roformer(batch):
    cfg = _small(T.RoFormerConfig, embedding_size=64, max_position_embeddings=64)
    return _lm(T.RoFormerForMaskedLM, cfg, batch)

def luke(batch):
    cfg = _small(T.LukeConfig, entity_vocab_size=20, entity_emb_size=32, max_position_embeddings=64)
    return _lm(T.LukeForMaskedLM, cfg, batch)

def nystromformer(batch):
    cfg = _small(T.NystromformerConfig, num_landmarks=4, segment_means_seq_len=16, max_position_embeddings=64,
                 conv_kernel_size=3)
    return _lm(T.NystromformerForMaskedLM, cfg, batch)

def rembert(batch):
    cfg = _small(T.RemBertConfig, input_embedding_size=32, output_embedding_size=32, max_position_embeddings=64)
    return _lm(T.RemBertForMaskedLM, cfg, batch)

def data2vec_text(batch):
    cfg = _small(T.Data2VecTextConfig, max_position_embeddings=64)
    return _lm(T.Data2VecTextForMaskedLM, cfg, batch)

def deit(batch):
    torch.manual_seed(0)
    cfg = T.DeiTConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, image_size=32,
                       patch_size=8, num_labels=5)
    return T.DeiTForImageClassificationWithTeacher(cfg), {"pixel_values": torch.randn(batch, 3, 32, 32)}

def swinv2(batch):
    torch.manual_seed(0)
    cfg = T.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                         num_labels=5, drop_path_rate=0.1)
    return T.Swinv2ForImageClassification(cfg), {"pixel_values": torch.randn(batch, 3, 32, 32), "labels": torch.arange(batch) % 5}

def cvt(batch):
    torch.manual_seed(0)
    cfg = T.CvtConfig(embed_dim=[16, 32], num_heads=[1, 2], depth=[1, 2], patch_sizes=[7, 3], patch_stride=[4, 2],
                      patch_padding=[2, 1], stride_kv=[2, 2], mlp_ratio=[2.0, 2.0], attention_drop_rate=[0.0, 0.0],
                      drop_rate=[0.0, 0.0], drop_path_rate=[0.0, 0.1], qkv_bias=[True, True], cls_token=[False, True],
                      qkv_projection_method=["dw_bn", "dw_bn"], kernel_qkv=[3, 3], padding_kv=[1, 1],
                      stride_q=[1, 1], padding_q=[1, 1], num_labels=5)
    return T.CvtForImageClassification(cfg), {"pixel_values": torch.randn(batch, 3, 32, 32), "labels": torch.arange(batch) % 5}

def poolformer(batch):
    torch.manual_seed(0)
    cfg = T.PoolFormerConfig(depths=[1, 1, 2, 1], hidden_sizes=[16, 32, 48, 64], num_labels=5, drop_path_rate=0.1)
    return T.PoolFormerForImageClassification(cfg), {"pixel_values": torch.randn(batch, 3, 32, 32), "labels": torch.arange(batch) % 5}

def hiera(batch):
    torch.manual_seed(0)
    cfg = T.HieraConfig(embed_dim=16, image_size=[64, 64], patch_size=[7, 7], patch_stride=[4, 4], patch_padding=[3, 3],
                        depths=[1, 1, 2, 1], num_heads=[1, 2, 4, 8], num_labels=5, drop_path_rate=0.1)
    return T.HieraForImageClassification(cfg), {"pixel_values": torch.randn(batch, 3, 64, 64), "labels": torch.arange(batch) % 5}

def yolos(batch):
    torch.manual_seed(0)
    cfg = T.YolosConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
                        image_size=[32, 32], patch_size=8, num_detection_tokens=5, use_mid_position_embeddings=False)
    return T.YolosModel(cfg), {"pixel_values": torch.randn(batch, 3, 32, 32)}

def data2vec_audio(batch):
    torch.manual_seed(0)
    cfg = T.Data2VecAudioConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
                                num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, conv_pos_kernel_size=3, layerdrop=0.0,
                                num_conv_pos_embeddings_layers=1, mask_time_prob=0.0)
    return T.Data2VecAudioModel(cfg), {"input_values": torch.randn(batch, 800)}

def speech2text(batch):
    torch.manual_seed(0)
    cfg = T.Speech2TextConfig(vocab_size=50, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, input_feat_per_channel=16,
                              conv_channels=32, num_conv_layers=2, max_source_positions=64, max_target_positions=32,
                              use_cache=False)
    return T.Speech2TextForConditionalGeneration(cfg), {"input_features": torch.randn(batch, 40, 16), "labels": _ids(batch, 8, 50)}

def unispeech_sat(batch):
    torch.manual_seed(0)
    cfg = T.UniSpeechSatConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                               conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
                               num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, mask_time_prob=0.0, layerdrop=0.0)
    return T.UniSpeechSatModel(cfg), {"input_values": torch.randn(batch, 800)}

def layoutlm(batch):
    torch.manual_seed(0)
    cfg = _small(T.LayoutLMConfig, max_position_embeddings=64, max_2d_position_embeddings=128)
    x = _ids(batch, 16)
    box = torch.randint(0, 60, (batch, 16, 2))
    bbox = torch.cat([box, box + 5], -1)
    return T.LayoutLMForMaskedLM(cfg), {"input_ids": x, "bbox": bbox, "labels": x}

def vilt(batch):
    torch.manual_seed(0)
    cfg = T.ViltConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
                       image_size=32, patch_size=8, max_position_embeddings=32, num_images=1, modality_type_vocab_size=2)
    return T.ViltModel(cfg), {"input_ids": _ids(batch, 8), "pixel_values": torch.randn(batch, 3, 32, 32),
                              "pixel_mask": torch.ones(batch, 32, 32, dtype=torch.long)}

def siglip(batch):
    torch.manual_seed(0)
    t = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=16)
    v = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)
    cfg = T.SiglipConfig(text_config=t, vision_config=v)
    return T.SiglipModel(cfg), {"input_ids": _ids(batch, 16), "pixel_values": torch.randn(batch, 3, 32, 32),
                                "return_loss": True}

def bigbird_pegasus(batch):
    torch.manual_seed(0)
    cfg = T.BigBirdPegasusConfig(vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                 max_position_embeddings=256, attention_type="block_sparse", block_size=8,
                                 num_random_blocks=2, use_cache=False)
    return T.BigBirdPegasusForConditionalGeneration(cfg), {"input_ids": _ids(batch, 128), "labels": _ids(batch, 12)}



def falcon_mamba(batch):
    cfg = T.FalconMambaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3, state_size=8, use_cache=False,
                              use_mambapy=True)
    return _lm(T.FalconMambaForCausalLM, cfg, batch)

def dbrx(batch):
    cfg = T.DbrxConfig(vocab_size=100, d_model=64, n_layers=3, n_heads=4, max_seq_len=64,
                       attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}, ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4,
                                                                   "moe_top_k": 2}, use_cache=False)
    return _lm(T.DbrxForCausalLM, cfg, batch)

def jetmoe(batch):
    cfg = T.JetMoeConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_key_value_heads=2, kv_channels=16,
                         intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    return _lm(T.JetMoeForCausalLM, cfg, batch)

def gpt_oss(batch):
    cfg = T.GptOssConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
                         num_experts_per_tok=2, sliding_window=8, use_cache=False,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return _lm(T.GptOssForCausalLM, cfg, batch)

def qwen3_moe(batch):
    cfg = T.Qwen3MoeConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2, use_cache=False, decoder_sparse_step=1)
    return _lm(T.Qwen3MoeForCausalLM, cfg, batch)

def pix2struct(batch):
    torch.manual_seed(0)
    t = dict(vocab_size=50, hidden_size=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, use_cache=False)
    v = dict(hidden_size=32, patch_embed_hidden_size=48, d_kv=16, d_ff=64, num_hidden_layers=2, num_attention_heads=2)
    cfg = T.Pix2StructConfig(text_config=t, vision_config=v)
    patches = torch.randn(batch, 16, 50)
    patches[..., 0], patches[..., 1] = torch.arange(16) // 4 + 1, torch.arange(16) % 4 + 1
    return T.Pix2StructForConditionalGeneration(cfg), {"flattened_patches": patches,
                                                        "attention_mask": torch.ones(batch, 16), "labels": _ids(batch, 8, 50)}

def trocr(batch):
    torch.manual_seed(0)
    enc = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                      patch_size=8)
    dec = T.TrOCRConfig(vocab_size=50, d_model=32, decoder_layers=2, decoder_attention_heads=2, decoder_ffn_dim=64,
                        use_cache=False, max_position_embeddings=32)
    cfg = T.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 1, 0
    return T.VisionEncoderDecoderModel(cfg), {"pixel_values": torch.randn(batch, 3, 32, 32), "labels": _ids(batch, 8, 50)}
