"""Phantom chest X-rays: the embedded, deterministic default data source of cxrdr.

Every study is a function of ``(seed, index)``: ``cases`` samples what it shows (ids, body
geometry, findings with kind/side/zone/severity) without pixels, ``report`` turns that into
report text, triples and CheXpert-14 labels, ``render`` draws the image and measures the
finding boxes, and ``source`` exposes it as a ``Source`` (``phantom[:N]``) and as files
(``reinforce phantom --n N --out DIR``).

Box labels are the finding names: cardiomegaly, pleural_effusion, pneumothorax, nodule, mass,
consolidation, lung_opacity, atelectasis, edema, support_device (one box per device).
"""
from cxrdr.reinforce.phantom.cases import Case, Finding, sample_case, subject_layout
from cxrdr.reinforce.phantom.render import finding_boxes, render_case
from cxrdr.reinforce.phantom.report import make_report, make_triples
from cxrdr.reinforce.phantom.source import (PhantomSource, cli_phantom, phantom_record, record_row,
                                      render_phantom, split_for_subject, write_phantom_dataset)

__all__ = ["Case", "Finding", "PhantomSource", "cli_phantom", "finding_boxes", "make_report",
           "make_triples", "phantom_record", "record_row", "render_case", "render_phantom",
           "sample_case", "split_for_subject", "subject_layout", "write_phantom_dataset"]
