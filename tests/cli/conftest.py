"""The command tests use the fixtures of the packages their commands drive."""

from tests.encoder.conftest import minilm_dir  # noqa: F401
from tests.helpers.encoders import encoder  # noqa: F401
from tests.train.conftest import _one_torch_thread, tiny_model_dir  # noqa: F401
