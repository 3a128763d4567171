import pytest

from meshforge.metrics.tensorboard import TensorBoardWriter, crc32c, read_scalars


def test_crc32c_known_vector():
    assert crc32c(b"123456789") == 0xE3069283


def test_scalars_round_trip(tmp_path):
    w = TensorBoardWriter(tmp_path)
    w.add_scalars(1, {"loss": 2.5, "lr": 1e-3})
    w.add_scalars(300, {"loss": 1.25})
    w.close()
    got = read_scalars(w.path)
    assert got[0] == (1, "loss", 2.5)
    assert got[1][:2] == (1, "lr") and got[1][2] == pytest.approx(1e-3)
    assert got[2] == (300, "loss", 1.25)


def test_corruption_is_detected(tmp_path):
    w = TensorBoardWriter(tmp_path)
    w.add_scalars(1, {"loss": 2.5})
    w.close()
    data = bytearray(w.path.read_bytes())
    data[-6] ^= 0xFF
    w.path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC"):
        read_scalars(w.path)
