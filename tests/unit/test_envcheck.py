from vlmrl.envcheck import CUDNN_FIX, GOOD_CUDNN, check_environment, conv3d_cudnn_warning


def test_warns_for_torch_29_with_other_cudnn():
    msg = conv3d_cudnn_warning("2.9.1+cu128", True, "9.10.2.21")
    assert msg and "Conv3d" in msg and CUDNN_FIX in msg and "nvidia-cudnn-cu12==9.16.0.29" in msg


def test_unknown_cudnn_also_warns():
    assert conv3d_cudnn_warning("2.9.0", True, None)


def test_silent_otherwise():
    assert conv3d_cudnn_warning("2.9.1", True, GOOD_CUDNN) is None
    assert conv3d_cudnn_warning("2.9.1", False, "9.10.2.21") is None  # CPU
    assert conv3d_cudnn_warning("2.10.0", True, "9.10.2.21") is None
    assert conv3d_cudnn_warning("2.13.0+cpu", False, None) is None


def test_silent_on_this_cpu_machine(capsys):
    import torch

    if not torch.cuda.is_available():
        assert check_environment() == []
        assert capsys.readouterr().err == ""
