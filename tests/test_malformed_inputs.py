"""Malformed values in the files users hand leafpy (model files made by other writers, run files, CSV tables,
arrays), each through the command or the API a user goes through: a LeafpyError that names the place, never a
raw Python exception."""
from __future__ import annotations

import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from conftest import ROOT, child_env

import leafpy as lp
from leafpy import serialization as ser
from leafpy.errors import ConfigError, LeafpyError, SerializationError

HUGE = "1" + "0" * 400  # an integer past float's range (YAML and JSON read it as a Python int)


def leafpy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leafpy", *args], capture_output=True, text=True, errors="replace",
                          timeout=300, cwd=ROOT, env=child_env())


def _model(path) -> None:
    cfg = lp.SequentialConfig(inputs=[("data", [4, 1, 8, 8])])
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=10)))
    lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=0).save(str(path))


def _with_preparation(path, text: str) -> None:
    """The model at ``path`` rewritten with another data-preparation record (a valid file: header, checksum)."""
    msg = ser.editable_message(path, "Layer")
    msg.preparation = text
    path.write_bytes(ser.encode(msg, "Layer"))


def test_a_model_file_that_names_a_class_twice_still_loads_and_predicts(tmp_path):
    """Training refuses class names given twice, but a model file written with them (before that) is no damaged
    file: it loads, and predict names its classes as recorded."""
    path = tmp_path / "model.leaf"
    _model(path)
    names = ["cat", "cat"] + [f"c{k}" for k in range(2, 10)]
    _with_preparation(path, '{"class_names": ' + str(names).replace("'", '"') + "}")
    net = lp.Layer.load(lp.backend("native"), str(path))
    assert list(net.preparation.class_names) == names
    np.savez(tmp_path / "x.npz", x=np.zeros((2, *net.input_shapes[0][1:]), np.float32))
    p = leafpy("predict", str(path), "--input", str(tmp_path / "x.npz"))
    assert p.returncode == 0 and "predicted classes: " in p.stdout, p.stderr


def _resealed(data: bytes) -> bytes:
    """A leafpy file's bytes with its checksum made right again after an edit, as another writer would."""
    size = struct.calcsize("<8sIIQQI")
    crc = zlib.crc32(data[size:], zlib.crc32(data[:size - 4])) & 0xFFFFFFFF
    return data[:size - 4] + struct.pack("<I", crc) + data[size:]


@pytest.mark.parametrize("record", ["not utf-8", "huge mean", "deep nesting"])
def test_a_model_whose_data_preparation_is_malformed_gives_a_clear_error(tmp_path, record):
    path = tmp_path / "model.leaf"
    _model(path)
    if record == "not utf-8":
        _with_preparation(path, '{"class_names": ["AAAAAAAAAAAAAAAA"]}')
        data = bytearray(path.read_bytes())
        data[data.index(b"AAAAAAAA")] = 0xFF
        path.write_bytes(_resealed(bytes(data)))
    else:
        _with_preparation(path, '{"normalize": {"mean": [' + HUGE + '], "std": [1]}}' if record == "huge mean"
                          else "[" * 100_000)
    with pytest.raises(SerializationError, match="model.leaf"):
        lp.Layer.load(lp.backend("native"), str(path))


@pytest.mark.parametrize("setting,says", [
    (f"solver.loss_scale={HUGE}", "solver.loss_scale"),
    (f"data.normalize={{mean: [{HUGE}], std: [1]}}", "data.normalize.mean"),
    ("data.class_names=7", "data.class_names"),
    ("data.class_names=abcdefghij", "data.class_names"),  # a string is no list of ten names
    ("data.class_names=0", "data.class_names"),
    ("data.class_names=[a,a,b,c,d,e,f,g,h,i]", "data.class_names: 'a' named more than one class"),
])
def test_malformed_run_settings_give_clear_errors_from_the_command(tmp_path, setting, says):
    r = leafpy("train", "configs/digits_mlp.yaml", "--epochs", "1", "--out", str(tmp_path / "run"), "--set", setting)
    assert r.returncode == 1, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run" / "model.leaf").exists()


def test_a_huge_static_loss_scale_is_refused_by_the_solver_config():
    with pytest.raises(ConfigError, match="solver.loss_scale"):
        lp.SolverConfig(loss_scale=10 ** 400)


def test_a_csv_header_that_names_a_column_twice_is_refused(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("f1,f1,f3,label\n" + "".join(f"{i},{100 + i},{200 + i},{'ab'[i % 2]}\n" for i in range(8)))
    with pytest.raises(LeafpyError, match=r"line 1: the header names column 'f1' twice \(columns 1 and 2\)"):
        lp.data.csv(str(path), "label")


def test_a_csv_with_unnamed_trailing_columns_reads_its_named_features(tmp_path):
    """A spreadsheet's export with empty columns after the last (unnamed, repeated ''), the features named."""
    path = tmp_path / "table.csv"
    path.write_text("f1,f2,label,,\n" + "".join(f"{i},{2 * i},{'ab'[i % 2]},,\n" for i in range(10)))
    ds = lp.data.csv(str(path), "label", features=["f1", "f2"], test_fraction=0.2)
    x = np.concatenate([np.asarray(ds.x_train), np.asarray(ds.x_test)])
    assert x.shape == (10, 2) and sorted(x[:, 1] / 2) == sorted(x[:, 0])
    # without features: the named columns (an unnamed one read as '' would be the first '' over and over)
    for text in ("f1,f2,label,,\n" + "".join(f"{i},{2 * i},{'ab'[i % 2]},,\n" for i in range(10)),
                 ",f1,f2,label\n" + "".join(f"{i},{i},{2 * i},{'ab'[i % 2]}\n" for i in range(10))):  # pandas' index
        path.write_text(text)
        ds = lp.data.csv(str(path), "label", test_fraction=0.2)
        assert ds.feature_names == ("f1", "f2")
        x = np.concatenate([np.asarray(ds.x_train), np.asarray(ds.x_test)])
        assert sorted(x[:, 1] / 2) == sorted(x[:, 0]) == list(range(10))
    with pytest.raises(LeafpyError, match="'' names no column"):
        lp.data.csv(str(path), "label", features=["f1", ""])


@pytest.mark.parametrize("text", ["label\n" + "ab\n" * 10, ",label\n" + "1,ab\n" * 10],
                         ids=["the target alone", "the target and an unnamed column"])
def test_a_csv_without_feature_columns_is_refused(tmp_path, text):
    """A table whose only named column is the target read as samples of no values, x [N, 0], silently."""
    path = tmp_path / "table.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"table\.csv: no feature columns: the header names only the target column "
                                          r"'label'"):
        lp.data.csv(str(path), "label")


def test_a_csv_whose_numbers_pass_the_memory_available_is_refused_while_it_is_read(tmp_path, monkeypatch):
    """The table is read a block of rows at a time into float32 arrays: one whose arrays (twice, while the blocks
    are joined) pass the memory available is refused once a block shows it, not left to thrash under ulimit -v."""
    from leafpy.sources import csv_table

    path = tmp_path / "table.csv"
    path.write_text("f1,label\n" + "1,2\n" * 40_000)
    monkeypatch.setattr(csv_table, "available_memory", lambda: 2**16)
    with pytest.raises(LeafpyError, match=r"table\.csv: its first 16,384 rows already take 320\.0 KB as numbers "
                                          r"\(twice that while they are joined\), more than the 64\.0 KB of memory "
                                          r"available; convert it to an \.npz file"):
        lp.data.csv(str(path), "label")
    monkeypatch.setattr(csv_table, "available_memory", lambda: 2**23)
    assert lp.data.csv(str(path), "label", test_fraction=0.5).x_train.shape == (20_000, 1)


def test_a_long_csv_is_read_in_the_memory_of_its_numbers(tmp_path):
    """A table was read whole as Python lists and strings, over 100 times its numbers' size (a 20 MB table took
    2.35 GB): 120,000 rows of 8 features now read within a few times the float32 features' 3.7 MB, and hold the
    values NumPy's own text reader finds."""
    import tracemalloc

    rng = np.random.default_rng(7)
    x = rng.normal(size=(120_000, 8)).round(4)
    y = rng.integers(0, 3, 120_000)
    path = tmp_path / "long.csv"
    with open(path, "w", newline="") as f:
        f.write(",".join(f"f{j}" for j in range(8)) + ",label\r\n")
        f.writelines(",".join(f"{v:.4f}" for v in row) + f",{c}\r\n" for row, c in zip(x, y))
    tracemalloc.start()
    try:
        ds = lp.data.csv(str(path), "label", test_fraction=0.0001)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    numbers = 120_000 * 8 * 4
    assert peak < 4 * numbers, f"peak {peak} bytes for {numbers} bytes of features"
    reference = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64)
    got_x = np.concatenate([np.asarray(ds.x_train), np.asarray(ds.x_test)])
    got_y = np.concatenate([np.asarray(ds.y_train), np.asarray(ds.y_test)]).reshape(-1)
    order = np.lexsort(got_x.T[::-1])
    want = np.lexsort(reference[:, :8].T[::-1])
    np.testing.assert_allclose(got_x[order], reference[want, :8], rtol=1e-6)
    np.testing.assert_array_equal(got_y[order], reference[want, 8].astype(int))


def test_csv_class_labels_written_as_floats_are_the_integers_they_hold(tmp_path):
    """An integer label column as a tool writes floats (1.0, 2.00) names the classes 1, 2 and 10, in numeric
    order, however each row writes them; other text stays a name of its own."""
    path = tmp_path / "table.csv"
    labels = ["1", "2.0", "10.0", "1.0", "2", "10", "1.00", "2", "10", "1"]
    path.write_text("f1,label\n" + "".join(f"{i},{t}\n" for i, t in enumerate(labels)))
    ds = lp.data.csv(str(path), "label", test_fraction=0.0001)
    assert ds.class_names == ("1", "2", "10")
    x = np.concatenate([np.asarray(ds.x_train), np.asarray(ds.x_test)])[:, 0].astype(int)
    y = np.concatenate([ds.y_train, ds.y_test])
    truth = {"1": 0, "2": 1, "10": 2}
    assert [int(v) for v in y] == [truth[labels[i].split(".")[0]] for i in x]
    path.write_text("f1,label\n" + "".join(f"{i},{t}\n" for i, t in enumerate(["1.5", "1.50", "a", "1.0"] * 3)))
    assert lp.data.csv(str(path), "label", test_fraction=0.0001).class_names == ("1", "1.5", "1.50", "a")


@pytest.mark.parametrize("text,line,column", [
    ("f1,f2,label\n\n\n1,2,a\n\n3,,b\n", 6, "f2"),  # blank lines before it
    ('f1,f2,label\n1,2,"a\nb"\n3,,b\n', 4, "f2"),  # a quoted cell over two lines before it
    ("f1,f2,label\n\n\n1,2,a\n3,4,\n", 5, "label"),  # a missing target
    ('f1,f2,label\n"1\n",2,a\n3,x,b\n', 4, "f2"),
])
def test_csv_errors_name_the_line_the_row_is_on(tmp_path, text, line, column):
    path = tmp_path / "table.csv"
    path.write_text(text)
    with pytest.raises(LeafpyError, match=rf"line {line}, column '{column}'"):
        lp.data.csv(str(path), "label")


def test_csv_predictions_name_the_lines_their_rows_are_on(tmp_path):
    """``leafpy predict --input table.csv`` labels each prediction with its row's line, blank lines counted."""
    rows = "".join(f"{i % 3},{(i * 7) % 5},{'ab'[i % 2]}\n" for i in range(40))
    (tmp_path / "train.csv").write_text("f1,f2,label\n" + rows)
    (tmp_path / "run.yaml").write_text(f"""
name: table
data: {{dataset: csv, path: {tmp_path / 'train.csv'}, target: label, batch_size: 8, test_fraction: 0.25, seed: 0}}
train: {{epochs: 1}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [null, 2]}}]
  layers:
    - {{name: fc, type: Linear, output_size: 2}}
    - {{name: logsm, type: LogSoftmax}}
objective: nll
solver: {{solver: momentum, base_lr: 0.05, momentum: 0.9, seed: 0}}
""")
    r = leafpy("train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    (tmp_path / "new.csv").write_text("f1,f2\n\n1,2\n\n\n2,3\n")
    r = leafpy("predict", str(tmp_path / "out"), "--input", str(tmp_path / "new.csv"))
    assert r.returncode == 0, r.stderr
    assert "line 3" in r.stdout and "line 6" in r.stdout and "line 2" not in r.stdout, r.stdout


@pytest.mark.parametrize("memory_map", [False, True])
def test_an_array_of_no_samples_is_refused_mapped_or_not(tmp_path, memory_map):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.float32(1.0), y=np.int64(0))
    with pytest.raises(LeafpyError, match=r"x must hold samples as \[N, \.\.\.\]"):
        lp.data.npz(str(path), memory_map=memory_map)


# --- image folders ------------------------------------------------------------------------------------------------
def _folder(root, classes=("a", "b"), per_class=3, size=8):
    from PIL import Image
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(np.full((size, size, 3), 30 * i, np.uint8)).save(root / c / f"{i}.png")
    return root


def _odd_tiff(path) -> None:
    """A TIFF whose StripOffsets tag says UNDEFINED (7) instead of LONG: Pillow's reader raises TypeError."""
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.zeros((4, 4), np.float32), "F").save(buf, "TIFF")
    b = bytearray(buf.getvalue())
    ifd = struct.unpack_from("<I", b, 4)[0]
    for k in range(struct.unpack_from("<H", b, ifd)[0]):
        entry = ifd + 2 + 12 * k
        if struct.unpack_from("<H", b, entry)[0] == 273:
            struct.pack_into("<H", b, entry + 2, 7)
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("odd", ["dangling link", "empty first file", "odd TIFF"])
def test_an_image_folder_with_a_file_that_does_not_decode_names_it_or_skips_it(tmp_path, odd):
    """No image size given (the first image's is taken): a link to nothing (a photo library moved), an empty file
    where the first image should be, a TIFF that Pillow's reader trips over. Each is an error naming the file, or
    with skip_unreadable left out, the rest loaded."""
    pytest.importorskip("PIL")
    root = _folder(tmp_path / "photos")
    bad = {"dangling link": root / "a" / "zz.png", "empty first file": root / "a" / "0.png",
           "odd TIFF": root / "b" / "odd.tiff"}[odd]
    if odd == "dangling link":
        bad.symlink_to(tmp_path / "moved" / "x.png")
    elif odd == "empty first file":
        bad.write_bytes(b"")
    else:
        _odd_tiff(bad)
    run = _image_run(tmp_path, root)
    r = leafpy("train", str(run), "--out", str(tmp_path / "run"))
    assert r.returncode == 1 and f"{bad.name}: cannot decode the image" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    ds = lp.data.image_folder(str(root), cache_dir=None, skip_unreadable=True)
    assert len(ds.x_train) + len(ds.x_test) == (5 if odd == "empty first file" else 6)
    assert ds.input_shape == (3, 8, 8)


def _image_run(tmp_path, root, size=""):
    path = tmp_path / "run.yaml"
    path.write_text(f"""
name: imgs
data: {{dataset: image_folder, path: {root}, channels: 3, batch_size: 4, cache_dir: null{size}}}
train: {{epochs: 1}}
network: {{type: Sequential, inputs: [{{name: data, shape: [null, 3, 8, 8]}}],
  layers: [{{name: flat, type: Flatten}}, {{name: fc, type: Linear, output_size: 2}}, {{name: sm, type: LogSoftmax}}]}}
objective: nll
solver: {{solver: momentum, base_lr: 0.05, momentum: 0.9, seed: 0}}
""")
    return path


def test_predictions_for_files_whose_names_are_no_utf8_are_written(tmp_path):
    """``leafpy predict RUN --input FOLDER --out predictions.csv`` over a folder holding a file named in Latin-1
    bytes (a camera's, an old archive's): the CSV is written, that row's name in the file system's bytes."""
    pytest.importorskip("PIL")
    from PIL import Image
    _image_run(tmp_path, _folder(tmp_path / "photos", ("cat", "dog"), 6), ", image_size: [8, 8]")
    assert leafpy("train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")).returncode == 0
    (tmp_path / "new").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(bytes(tmp_path / "new") + b"/caf\xe9.png")
    r = leafpy("predict", str(tmp_path / "run"), "--input", str(tmp_path / "new"), "--out", str(tmp_path / "p.csv"))
    assert r.returncode == 0, r.stderr
    rows = (tmp_path / "p.csv").read_bytes().splitlines()
    assert rows[0].startswith(b"input,class,probability") and rows[1].startswith(b"caf\xe9.png,"), rows


@pytest.mark.parametrize("shape", [None, ("a",), (2, 1.5), (2, True), "23", (2 ** 40, 2 ** 40), (-1, 3)])
def test_a_tensor_of_a_shape_that_is_no_shape_is_refused(shape):
    with pytest.raises(lp.errors.ShapeError, match="tensor shape"):
        lp.SharedTensor(shape)


def test_tensor_shapes_as_users_give_them():
    for shape, expected in ((3, (3,)), (np.int64(3), (3,)), ([2, 3], (2, 3)), (np.array([2, 3]), (2, 3)),
                            (range(1, 3), (1, 2)), ((), ())):
        assert lp.SharedTensor(shape).shape == expected


@pytest.mark.parametrize("given", ["new.csv", "photo.png", "images"])
def test_a_model_file_alone_asked_to_read_a_table_or_images_says_what_it_reads(tmp_path, given):
    r = leafpy("train", "configs/digits_mlp.yaml", "--epochs", "1", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    alone = tmp_path / "alone.leaf"
    alone.write_bytes((tmp_path / "run" / "model.leaf").read_bytes())
    (tmp_path / "new.csv").write_text("a,b\n1,2\n")
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "images").mkdir()
    p = leafpy("predict", str(alone), "--input", str(tmp_path / given))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "alone reads samples from an .npz file" in p.stderr and "run directory" in p.stderr, p.stderr


def test_a_wide_csv_table_reads_its_columns_by_name_in_one_pass(tmp_path):
    """Columns are found by name through one table of the header (each was a scan of it: a million columns took
    hours), and a block of rows holds at most BLOCK_VALUES values: 5,000 columns read as NumPy's text reader reads
    them, in blocks of 838 rows."""
    from leafpy.sources import csv_table

    assert csv_table.BLOCK_VALUES // 5_000 == 838
    rng = np.random.default_rng(4)
    x = rng.integers(-50, 50, (3, 5_000))
    path = tmp_path / "wide.csv"
    path.write_text(",".join(f"c{j}" for j in range(5_000)) + ",label\n"
                    + "".join(",".join(map(str, row)) + f",{k}\n" for k, row in enumerate(x)))
    ds = lp.data.csv(str(path), "label", test_fraction=0.34)
    got = np.concatenate([np.asarray(ds.x_train), np.asarray(ds.x_test)])
    reference = np.loadtxt(path, delimiter=",", skiprows=1)
    assert got.shape == (3, 5_000) and ds.feature_names[-1] == "c4999"
    np.testing.assert_array_equal(np.sort(got[:, 0]), np.sort(reference[:, 0]))
    assert {tuple(r) for r in got.astype(int).tolist()} == {tuple(r) for r in reference[:, :-1].astype(int).tolist()}
