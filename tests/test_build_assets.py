"""The asset builder on a tiny model: a hot-start matrix and acceptance statistics that the engine then uses."""

import json

from tr_core.assets import acceptance_path, hot_start_path
from tr_core.engine import Engine, EngineConfig
from tr_core.fitting import auto_tree
from tr_core.matrix import AdjacencyMatrix
from tr_core.models import load_model
from tr_core.tools.build_assets import main


def test_build_assets_then_fit_a_tree_from_them(tiny_folder, tmp_path):
    folder, model, tokenizer = tiny_folder
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# comment\nCount to ten.\nName a colour.\nSay hi.\nList two fruits.\n")
    hot, accepted = tmp_path / "hot_start", tmp_path / "acceptance"
    assert main(["--model", str(folder), "--max-new-tokens", "8", "--prompts", str(prompts),
                 "--hot-start-dir", str(hot), "--acceptance-dir", str(accepted)]) == 0
    slug = folder.name.lower()
    matrix = AdjacencyMatrix.load(hot_start_path(slug, 8, hot), vocab_size=len(tokenizer), k=8)
    assert int((matrix.rows != 0).any(dim=1).sum()) > 0
    stats = json.loads(acceptance_path(slug, accepted).read_text())
    assert stats["tree"] == "paper" and len(stats["acceptance"]) == len(stats["node_paths"]) == 81
    assert stats["acceptance"][0] == 1.0 and stats["prompts_counted"] == 2
    assert set(stats["size_factors"]) == set(stats["measured_mean_accepted_tokens"]) == {"2", "4", "8", "16"}
    assert all(m >= 1.0 for m in stats["measured_mean_accepted_tokens"].values())
    # every child is at most as likely as its parent: the acceptance order gives valid trees
    index = {tuple(p): i for i, p in enumerate(stats["node_paths"])}
    for p, a in zip(stats["node_paths"][1:], stats["acceptance"][1:]):
        assert a <= stats["acceptance"][index[tuple(p[:-1])]]
    loaded, _ = load_model(str(folder))  # assets are filed under the model's folder name
    fitted = auto_tree(loaded, acceptance_dir=accepted, size=5)
    assert fitted.tree.size == 5 and fitted.tree.name == "auto-5"
    engine = Engine(model, tokenizer, EngineConfig(tree="paper"))
    assert engine.tree.size == 81
