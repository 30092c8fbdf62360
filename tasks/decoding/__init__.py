"""One job's CPU stage: the preprocess task's work (preprocess.py) and the decode it runs (imaging.py), each image's
cost judged from its bytes before Pillow pays it (structure.py, png_text.py, peak_memory.py, bmp_rle.py). No torch,
no Celery."""
