"""The model's weights outside a snapshot: `model.pt` (model_file.py: written at the end of a run,
read by sample.py and model.init_from), a snapshot consolidated into one (consolidate.py:
export.py), and Hugging Face GPT-2 folders in and out (pretrained.py: model.init_from, export.py
--format hf)."""
