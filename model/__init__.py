"""attnlab models: pure attention functions and the Flax families on them."""

from model import attention
from model.config import ModelConfig
from model.families import DecoderLM, EncoderClassifier, EncoderDecoder, build

__all__ = ['attention', 'ModelConfig', 'DecoderLM', 'EncoderDecoder',
           'EncoderClassifier', 'build']
