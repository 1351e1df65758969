"""bmtrain.debug: BMTrain keeps a few tensors by name for debugging; the same small registry."""
_tensors = {}


def set(key, value):  # noqa: A001  (BMTrain's name)
    _tensors[key] = value


def get(key, default=None):
    return _tensors.get(key, default)


def append(key, value):
    _tensors.setdefault(key, []).append(value)


def extend(key, values):
    _tensors.setdefault(key, []).extend(values)
