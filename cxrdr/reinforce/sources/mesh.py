"""MeSH-style codes of the Open-i / IU X-ray reports -> RDF triples and CheXpert-style labels.

A code is ``Head/qualifier/qualifier/...`` (e.g. ``Opacity/lung/base/left/mild``); the order of the
qualifiers varies. ``normal`` and ``No Indexing`` are special values, not findings.

How a code is read
------------------
1. The head term (case- and whitespace-insensitive) is looked up in ``FINDING_TERMS`` (a finding:
   ``Pleural Effusion``) or ``ANATOMY_TERMS`` (an organ whose *state* qualifier is the finding:
   ``Aorta/tortuous``, ``Lung/hypoinflation``, ``Cardiac Shadow/enlarged``).
2. Every qualifier is classified by ``QUALIFIERS``:
   - ``laterality``  right / left / bilateral,
   - ``severity``    mild, moderate, severe, small, large, borderline, minimal,
   - ``location``    anatomy words (lung, base, apex, upper lobe, lingula, hilum, retrocardiac, ...),
   - ``state``       words that name the finding of an anatomy head (enlarged, tortuous, elevated,
                     blunted, hypoinflation, degenerative, ...); on a finding head they are attributes,
   - ``attribute``   morphology/distribution/chronicity (patchy, multiple, chronic, interstitial, ...).
   A finding head may have *variants* keyed by a qualifier (``Thickening/pleura`` ->
   pleural_thickening, ``Markings/bronchovascular`` -> bronchovascular_markings).
3. Triples (subject = finding name in snake_case, as in CONTRACTS):
   - ``(finding, HAS_LOCATION, anatomy)``: laterality + location words, e.g. ``left_lung_base``,
     ``right_middle_lobe``, ``bilateral_hilum``; laterality alone is placed on the finding's default
     site (``right_hemithorax`` for pleural findings and devices, ``right_lung`` for lung findings);
   - ``(finding, HAS_SEVERITY, severity)``;
   - ``(finding, IS_A, category)`` from the table;
   - ``(finding, HAS_ATTRIBUTE, attribute)`` for descriptors (patchy, multiple, chronic, ...).
4. Labels (CheXpert-14 names): each table row may name labels with a value (1, or -1 where the
   code only suggests it, e.g. a blunted costophrenic angle -> Pleural Effusion -1). Per study the
   strongest value wins (1 over -1). ``No Finding`` follows CheXpert's rule: 1 when no pathology
   label (all but No Finding and Support Devices) is 1 or -1, else 0. A study coded exactly
   ``normal`` gets only ``No Finding: 1``; ``No Indexing`` alone gives no labels and no triples.
Unmapped head terms still yield a triple ``(snake_case(term), IS_A, unclassified_finding)`` plus
their location/severity triples, and are counted (``MeshResult.unmapped_terms``); unknown
qualifiers become attributes and are counted too (``MeshResult.unmapped_qualifiers``).
The table covers every head term and qualifier of the shared IU X-ray copy (121 head terms,
87 qualifiers); ``python -m cxrdr.reinforce.sources.mesh FILE.jsonl`` prints the coverage of a file.
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from cxrdr.common.labels import CHEXPERT14
from cxrdr.reinforce.records import Triple

SPECIAL_NORMAL = "normal"
SPECIAL_NO_INDEXING = "no indexing"

# Labels that count as a pathology for the CheXpert "No Finding" rule.
_PATHOLOGY_LABELS = tuple(n for n in CHEXPERT14 if n not in ("No Finding", "Support Devices"))


@dataclass(frozen=True)
class Term:
    """One row of the mapping table: the finding a head term (or variant) stands for."""

    finding: str
    category: str
    labels: tuple[tuple[str, int], ...] = ()
    site: str = "lung"  # where laterality alone places the finding: <side>_<site>


def _t(finding: str, category: str, *labels: str | tuple[str, int], site: str = "lung") -> Term:
    pairs = tuple((lab, 1) if isinstance(lab, str) else lab for lab in labels)
    return Term(finding, category, pairs, site)


# --- head terms that are findings -------------------------------------------------------------
# key: lower-case MeSH head term. Categories follow the contract vocabulary where one exists.
FINDING_TERMS: dict[str, Term] = {
    "opacity": _t("lung_opacity", "parenchymal_opacity", "Lung Opacity"),
    "density": _t("lung_opacity", "parenchymal_opacity", "Lung Opacity"),
    "airspace disease": _t("airspace_disease", "parenchymal_opacity", "Lung Opacity"),
    "infiltrate": _t("infiltrate", "parenchymal_opacity", "Lung Opacity"),
    "consolidation": _t("consolidation", "parenchymal_opacity", "Consolidation"),
    "pneumonia": _t("pneumonia", "infection", "Pneumonia", "Lung Opacity"),
    "pulmonary atelectasis": _t("atelectasis", "parenchymal_opacity", "Atelectasis"),
    "volume loss": _t("volume_loss", "lung_volume_abnormality", ("Atelectasis", -1)),
    "cardiomegaly": _t("cardiomegaly", "cardiac_abnormality", "Cardiomegaly", site="heart"),
    "pleural effusion": _t("pleural_effusion", "pleural_abnormality", "Pleural Effusion", site="hemithorax"),
    "pneumothorax": _t("pneumothorax", "pleural_abnormality", "Pneumothorax", site="hemithorax"),
    "hydropneumothorax": _t("hydropneumothorax", "pleural_abnormality", "Pneumothorax", "Pleural Effusion",
                            site="hemithorax"),
    "hemopneumothorax": _t("hemopneumothorax", "pleural_abnormality", "Pneumothorax", "Pleural Effusion",
                           site="hemithorax"),
    "hemothorax": _t("hemothorax", "pleural_abnormality", "Pleural Effusion", site="hemithorax"),
    "pulmonary edema": _t("edema", "pulmonary_edema", "Edema"),
    "pulmonary congestion": _t("pulmonary_congestion", "pulmonary_edema", "Edema"),
    "heart failure": _t("heart_failure", "cardiac_abnormality", ("Edema", -1), site="heart"),
    "nodule": _t("nodule", "lung_lesion", "Lung Lesion"),
    "mass": _t("mass", "lung_lesion", "Lung Lesion"),
    "cavitation": _t("cavitation", "lung_lesion", "Lung Lesion"),
    "cysts": _t("cyst", "lung_lesion", ("Lung Lesion", -1)),
    "calcified granuloma": _t("calcified_granuloma", "granulomatous_disease"),
    "granuloma": _t("granuloma", "granulomatous_disease"),
    "granulomatous disease": _t("granulomatous_disease", "granulomatous_disease"),
    "calcinosis": _t("calcification", "calcification"),
    "cicatrix": _t("scarring", "parenchymal_scarring"),
    "pulmonary fibrosis": _t("pulmonary_fibrosis", "interstitial_lung_disease"),
    "fibrosis": _t("fibrosis", "interstitial_lung_disease"),
    "lung diseases, interstitial": _t("interstitial_lung_disease", "interstitial_lung_disease"),
    "sarcoidosis": _t("sarcoidosis", "interstitial_lung_disease"),
    "markings": _t("increased_lung_markings", "interstitial_pattern"),
    "emphysema": _t("emphysema", "chronic_lung_disease"),
    "pulmonary emphysema": _t("emphysema", "chronic_lung_disease"),
    "bullous emphysema": _t("bullous_emphysema", "chronic_lung_disease"),
    "blister": _t("bulla", "chronic_lung_disease"),
    "pulmonary disease, chronic obstructive": _t("copd", "chronic_lung_disease"),
    "lung, hyperlucent": _t("hyperlucent_lung", "lung_volume_abnormality"),
    "cystic fibrosis": _t("cystic_fibrosis", "chronic_lung_disease"),
    "bronchiectasis": _t("bronchiectasis", "airway_abnormality"),
    "bronchitis": _t("bronchitis", "airway_abnormality"),
    "bronchiolitis": _t("bronchiolitis", "airway_abnormality"),
    "tuberculosis": _t("tuberculosis", "infection", ("Pneumonia", -1)),
    "lucency": _t("lucency", "lucency"),
    "thickening": _t("thickening", "soft_tissue_abnormality"),
    "atherosclerosis": _t("atherosclerosis", "vascular_abnormality", site="aorta"),
    "aortic aneurysm": _t("aortic_aneurysm", "vascular_abnormality", ("Enlarged Cardiomediastinum", -1),
                          site="aorta"),
    "hypertension, pulmonary": _t("pulmonary_hypertension", "vascular_abnormality"),
    "pericardial effusion": _t("pericardial_effusion", "cardiac_abnormality", ("Enlarged Cardiomediastinum", -1),
                               site="heart"),
    "epicardial fat": _t("epicardial_fat_pad", "normal_variant", site="heart"),
    "hernia, hiatal": _t("hiatal_hernia", "mediastinal_abnormality", site="mediastinum"),
    "hernia, diaphragmatic": _t("diaphragmatic_hernia", "diaphragmatic_abnormality", site="hemidiaphragm"),
    "diaphragmatic eventration": _t("diaphragmatic_eventration", "diaphragmatic_abnormality", site="hemidiaphragm"),
    "shift": _t("mediastinal_shift", "mediastinal_abnormality", site="mediastinum"),
    "pneumoperitoneum": _t("pneumoperitoneum", "abdominal_abnormality", site="abdomen"),
    "cholelithiasis": _t("cholelithiasis", "abdominal_abnormality", site="abdomen"),
    "colonic interposition": _t("colonic_interposition", "abdominal_abnormality", site="abdomen"),
    "subcutaneous emphysema": _t("subcutaneous_emphysema", "soft_tissue_abnormality", site="chest_wall"),
    "hypovolemia": _t("hypovolemia", "cardiac_abnormality", site="heart"),
    "nipple shadow": _t("nipple_shadow", "normal_variant", site="chest_wall"),
    "adipose tissue": _t("fat_deposition", "soft_tissue_abnormality", site="chest_wall"),
    "contrast media": _t("contrast_material", "technical"),
    "technical quality of image unsatisfactory": _t("suboptimal_image_quality", "technical"),
    # skeleton
    "fractures, bone": _t("fracture", "skeletal_abnormality", "Fracture", site="ribs"),
    "deformity": _t("deformity", "skeletal_abnormality"),
    "dislocations": _t("dislocation", "skeletal_abnormality", site="shoulder"),
    "scoliosis": _t("scoliosis", "skeletal_abnormality", site="spine"),
    "kyphosis": _t("kyphosis", "skeletal_abnormality", site="spine"),
    "osteophyte": _t("osteophyte", "skeletal_abnormality", site="spine"),
    "spondylosis": _t("spondylosis", "skeletal_abnormality", site="spine"),
    "arthritis": _t("arthritis", "skeletal_abnormality", site="shoulder"),
    "bone diseases, metabolic": _t("osteopenia", "skeletal_abnormality"),
    "osteoporosis": _t("osteoporosis", "skeletal_abnormality"),
    "sclerosis": _t("sclerosis", "skeletal_abnormality"),
    "expansile bone lesions": _t("expansile_bone_lesion", "skeletal_abnormality"),
    "hyperostosis, diffuse idiopathic skeletal": _t("diffuse_idiopathic_skeletal_hyperostosis",
                                                   "skeletal_abnormality", site="spine"),
    "funnel chest": _t("pectus_excavatum", "skeletal_abnormality", site="chest_wall"),
    "pectus carinatum": _t("pectus_carinatum", "skeletal_abnormality", site="chest_wall"),
    # devices and post-surgical change
    "catheters, indwelling": _t("catheter", "device", "Support Devices", site="hemithorax"),
    "tube, inserted": _t("tube", "device", "Support Devices", site="hemithorax"),
    "stents": _t("stent", "device", "Support Devices", site="hemithorax"),
    "implanted medical device": _t("implanted_device", "device", "Support Devices", site="hemithorax"),
    "medical device": _t("medical_device", "device", "Support Devices", site="hemithorax"),
    "surgical instruments": _t("surgical_instruments", "device", "Support Devices", site="hemithorax"),
    "foreign bodies": _t("foreign_body", "device", site="hemithorax"),
    "breast implants": _t("breast_implants", "device", site="breast"),
    "sutures": _t("sutures", "post_surgical_change", site="hemithorax"),
    "spinal fusion": _t("spinal_fusion", "post_surgical_change", site="spine"),
    "mastectomy": _t("mastectomy", "post_surgical_change", site="breast"),
    "pneumonectomy": _t("pneumonectomy", "post_surgical_change"),
}

# Variants of a finding head, chosen by the first qualifier that names one.
FINDING_VARIANTS: dict[str, dict[str, Term]] = {
    "thickening": {
        "pleura": _t("pleural_thickening", "pleural_abnormality", "Pleural Other", site="hemithorax"),
        "bronchovascular": _t("bronchial_wall_thickening", "airway_abnormality"),
        "bronchi": _t("bronchial_wall_thickening", "airway_abnormality"),
    },
    "markings": {
        "bronchovascular": _t("bronchovascular_markings", "interstitial_pattern"),
        "interstitial": _t("interstitial_markings", "interstitial_pattern"),
    },
    "calcinosis": {
        "aorta": _t("aortic_calcification", "vascular_abnormality", site="aorta"),
        "aorta, thoracic": _t("aortic_calcification", "vascular_abnormality", site="aorta"),
        "lymph nodes": _t("calcified_lymph_nodes", "granulomatous_disease"),
    },
    "deformity": {
        "ribs": _t("rib_deformity", "skeletal_abnormality", ("Fracture", -1), site="ribs"),
        "clavicle": _t("clavicle_deformity", "skeletal_abnormality", ("Fracture", -1), site="clavicle"),
        "thoracic vertebrae": _t("vertebral_deformity", "skeletal_abnormality", site="spine"),
        "lumbar vertebrae": _t("vertebral_deformity", "skeletal_abnormality", site="spine"),
    },
    "shift": {"trachea": _t("tracheal_deviation", "mediastinal_abnormality", site="trachea")},
    "pleural effusion": {},
}

# --- head terms that are anatomy: the state qualifier names the finding ------------------------
# organ: how the anatomy is written in locations; states: state word -> Term (else generic
# "<state>_<organ>" with the default category and no label).
ANATOMY_TERMS: dict[str, tuple[str, str, dict[str, Term]]] = {
    # head: (organ, default category, {state: Term})
    "lung": ("lung", "lung_abnormality", {
        "hypoinflation": _t("low_lung_volumes", "lung_volume_abnormality"),
        "hyperdistention": _t("hyperinflation", "lung_volume_abnormality"),
        "azygos lobe": _t("azygos_lobe", "normal_variant"),
    }),
    "cardiac shadow": ("cardiac_silhouette", "cardiac_abnormality", {
        "enlarged": _t("cardiomegaly", "cardiac_abnormality", "Cardiomegaly", site="heart"),
        "borderline": _t("cardiomegaly", "cardiac_abnormality", "Cardiomegaly", site="heart"),
        "prominent": _t("cardiomegaly", "cardiac_abnormality", ("Cardiomegaly", -1), site="heart"),
    }),
    "heart": ("heart", "cardiac_abnormality", {
        "enlarged": _t("cardiomegaly", "cardiac_abnormality", "Cardiomegaly", site="heart"),
    }),
    "heart atria": ("atrium", "cardiac_abnormality", {
        "enlarged": _t("atrial_enlargement", "cardiac_abnormality", ("Cardiomegaly", -1), site="heart"),
    }),
    "heart ventricles": ("ventricle", "cardiac_abnormality", {
        "enlarged": _t("ventricular_enlargement", "cardiac_abnormality", ("Cardiomegaly", -1), site="heart"),
    }),
    "mediastinum": ("mediastinum", "mediastinal_abnormality", {
        "prominent": _t("widened_mediastinum", "mediastinal_abnormality", "Enlarged Cardiomediastinum",
                        site="mediastinum"),
        "enlarged": _t("widened_mediastinum", "mediastinal_abnormality", "Enlarged Cardiomediastinum",
                       site="mediastinum"),
    }),
    "aorta": ("aorta", "vascular_abnormality", {
        "tortuous": _t("tortuous_aorta", "vascular_abnormality", site="aorta"),
        "enlarged": _t("enlarged_aorta", "vascular_abnormality", ("Enlarged Cardiomediastinum", -1), site="aorta"),
    }),
    "aorta, thoracic": ("thoracic_aorta", "vascular_abnormality", {
        "tortuous": _t("tortuous_aorta", "vascular_abnormality", site="aorta"),
        "enlarged": _t("enlarged_aorta", "vascular_abnormality", ("Enlarged Cardiomediastinum", -1), site="aorta"),
    }),
    "pulmonary artery": ("pulmonary_artery", "vascular_abnormality", {
        "enlarged": _t("enlarged_pulmonary_artery", "vascular_abnormality", site="hilum"),
        "prominent": _t("enlarged_pulmonary_artery", "vascular_abnormality", site="hilum"),
    }),
    "blood vessels": ("pulmonary_vessels", "vascular_abnormality", {}),
    "diaphragm": ("hemidiaphragm", "diaphragmatic_abnormality", {}),
    "costophrenic angle": ("costophrenic_angle", "pleural_abnormality", {
        "blunted": _t("blunted_costophrenic_angle", "pleural_abnormality", ("Pleural Effusion", -1),
                      site="costophrenic_angle"),
    }),
    "sulcus": ("costophrenic_sulcus", "pleural_abnormality", {
        "blunted": _t("blunted_costophrenic_angle", "pleural_abnormality", ("Pleural Effusion", -1),
                      site="costophrenic_angle"),
    }),
    "pleura": ("pleura", "pleural_abnormality", {
        "blunted": _t("blunted_costophrenic_angle", "pleural_abnormality", ("Pleural Effusion", -1),
                      site="costophrenic_angle"),
    }),
    "thoracic vertebrae": ("thoracic_spine", "skeletal_abnormality", {
        "degenerative": _t("degenerative_change", "skeletal_abnormality", site="thoracic_spine"),
    }),
    "lumbar vertebrae": ("lumbar_spine", "skeletal_abnormality", {
        "degenerative": _t("degenerative_change", "skeletal_abnormality", site="lumbar_spine"),
    }),
    "cervical vertebrae": ("cervical_spine", "skeletal_abnormality", {
        "degenerative": _t("degenerative_change", "skeletal_abnormality", site="cervical_spine"),
    }),
    "spine": ("spine", "skeletal_abnormality", {
        "degenerative": _t("degenerative_change", "skeletal_abnormality", site="spine"),
    }),
    "shoulder": ("shoulder", "skeletal_abnormality", {
        "degenerative": _t("degenerative_change", "skeletal_abnormality", site="shoulder"),
    }),
    "ribs": ("ribs", "skeletal_abnormality", {}),
    "humerus": ("humerus", "skeletal_abnormality", {}),
    "bone and bones": ("bones", "skeletal_abnormality", {}),
    "trachea": ("trachea", "airway_abnormality", {}),
    "trachea, carina": ("carina", "airway_abnormality", {}),
    "lymph nodes": ("lymph_nodes", "lymphadenopathy", {
        "enlarged": _t("lymphadenopathy", "lymphadenopathy"),
    }),
    "thorax": ("thorax", "chest_abnormality", {}),
    "abdomen": ("abdomen", "abdominal_abnormality", {}),
}

# --- qualifier words --------------------------------------------------------------------------
LATERALITY = ("right", "left", "bilateral")
SEVERITY = ("minimal", "mild", "borderline", "small", "moderate", "severe", "large")
# location word -> (rank, token); rank orders the parts: organ (0) before sub-region (1, 2).
LOCATION: dict[str, tuple[int, str]] = {
    "lung": (0, "lung"), "thorax": (0, "hemithorax"), "pleura": (0, "pleura"),
    "mediastinum": (0, "mediastinum"), "heart": (0, "heart"), "aorta": (0, "aorta"),
    "aorta, thoracic": (0, "thoracic_aorta"), "abdomen": (0, "upper_abdomen"), "breast": (0, "breast"),
    "neck": (0, "neck"), "shoulder": (0, "shoulder"), "humerus": (0, "humerus"), "clavicle": (0, "clavicle"),
    "sternum": (0, "sternum"), "ribs": (0, "ribs"), "spine": (0, "spine"),
    "thoracic vertebrae": (0, "thoracic_spine"), "lumbar vertebrae": (0, "lumbar_spine"),
    "cervical vertebrae": (0, "cervical_spine"), "diaphragm": (0, "hemidiaphragm"),
    "trachea": (0, "trachea"), "trachea, carina": (0, "carina"), "esophagus": (0, "esophagus"),
    "bronchi": (1, "bronchi"), "pulmonary artery": (1, "pulmonary_artery"), "blood vessels": (1, "vessels"),
    "coronary vessels": (1, "coronary_arteries"), "aortic valve": (1, "aortic_valve"),
    "mitral valve": (1, "mitral_valve"), "heart atria": (1, "atrium"), "heart ventricles": (1, "ventricle"),
    "breast implants": (1, "breast_implant"), "adipose tissue": (1, "soft_tissues"),
    "pulmonary alveoli": (1, "alveoli"),
    "base": (1, "base"), "apex": (1, "apex"), "hilum": (1, "hilum"), "upper lobe": (1, "upper_lobe"),
    "middle lobe": (1, "middle_lobe"), "lower lobe": (1, "lower_lobe"), "lingula": (1, "lingula"),
    "azygos lobe": (1, "azygos_lobe"), "retrocardiac": (1, "retrocardiac_region"),
    "paratracheal": (1, "paratracheal_region"), "supracardiac": (1, "supracardiac_region"),
    "costophrenic angle": (1, "costophrenic_angle"), "cardiophrenic angle": (1, "cardiophrenic_angle"),
    "sulcus": (1, "costophrenic_sulcus"), "lymph nodes": (2, "lymph_nodes"),
    "anterior": (-1, "anterior"), "posterior": (-1, "posterior"),
}
# State words: the finding of an anatomy head; an attribute on a finding head.
STATES = ("enlarged", "prominent", "tortuous", "elevated", "flattened", "blunted", "obscured",
          "degenerative", "hypoinflation", "hyperdistention", "healed", "abnormal")
ATTRIBUTES = ("multiple", "round", "patchy", "scattered", "streaky", "focal", "diffuse", "chronic",
              "acute", "irregular", "reticular", "interstitial", "bronchovascular", "multilobar")
# Sub-regions that already imply the lung ("left upper lobe", not "left lung upper lobe").
_LUNG_IMPLIED = {"upper_lobe", "middle_lobe", "lower_lobe", "lingula", "hilum", "azygos_lobe",
                 "retrocardiac_region", "costophrenic_angle", "costophrenic_sulcus"}


def qualifier_kind(word: str) -> str:
    """'laterality', 'severity', 'location', 'state', 'attribute' or 'unknown'."""
    if word in LATERALITY:
        return "laterality"
    if word in SEVERITY:
        return "severity"
    if word in LOCATION:
        return "location"
    if word in STATES:
        return "state"
    if word in ATTRIBUTES:
        return "attribute"
    return "unknown"


def snake(text: str) -> str:
    """'Catheters, Indwelling' -> 'catheters_indwelling'."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


@dataclass
class MeshResult:
    """What a list of MeSH codes says about one study."""

    triples: list[Triple] = field(default_factory=list)
    labels: dict[str, int | None] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    normal: bool = False
    no_indexing: bool = False
    n_terms: int = 0  # non-special codes
    mapped_terms: int = 0
    unmapped_terms: list[str] = field(default_factory=list)
    unmapped_qualifiers: list[str] = field(default_factory=list)


def _anatomy(laterality: str | None, locations: list[str], site: str) -> str | None:
    """Laterality + location words -> one anatomy token, e.g. left_lung_base, right_upper_lobe."""
    parts = sorted({LOCATION[w] for w in locations}, key=lambda rt: (rt[0], rt[1]))
    tokens = [tok for _, tok in parts]
    if "lung" in tokens and any(t in _LUNG_IMPLIED for t in tokens):
        tokens.remove("lung")
    for sub in ("base", "apex"):  # lung/pleura + base -> lung_base (the "left lung base")
        if sub in tokens and set(tokens) <= {"lung", "pleura", sub}:
            tokens = [f"lung_{sub}"]
    if not tokens:
        if laterality is None:
            return None
        tokens = [site]
    return "_".join(([laterality] if laterality else []) + tokens)


def parse_code(code: str) -> tuple[Term | None, str, list[str]]:
    """One MeSH code -> (table row or None when unmapped, head, qualifiers in lower case)."""
    parts = [_norm(p) for p in code.split("/")]
    head, quals = parts[0], [q for q in parts[1:] if q]
    if head in FINDING_TERMS:
        variants = FINDING_VARIANTS.get(head, {})
        term = next((variants[q] for q in quals if q in variants), FINDING_TERMS[head])
        return term, head, quals
    if head in ANATOMY_TERMS:
        organ, category, states = ANATOMY_TERMS[head]
        state = next((q for q in quals if q in states), None)
        if state is not None:
            return states[state], head, quals
        # No table row: name the finding after its state and the most specific anatomy named.
        state = next((q for q in quals if q in STATES), None)
        places = sorted((LOCATION[q] for q in quals if q in LOCATION), key=lambda rt: rt[0])
        part = places[-1][1] if places and places[-1][0] >= 0 else organ
        if part == "lymph_nodes" and state in ("enlarged", "prominent"):
            return _t("lymphadenopathy", "lymphadenopathy", site=organ), head, quals
        finding = f"{state}_{part}" if state else f"{part}_abnormality"
        return Term(finding, category, (), organ), head, quals
    return None, head, quals


def mesh_to_annotations(codes: Iterable[str]) -> MeshResult:
    """All codes of one study -> triples (deduplicated, in code order), labels and counters."""
    result = MeshResult()
    seen: set[Triple] = set()
    label_values: dict[str, int] = {}

    def add(triple: Triple) -> None:
        if triple not in seen:
            seen.add(triple)
            result.triples.append(triple)

    for code in codes:
        text = _norm(code)
        if text == SPECIAL_NORMAL:
            result.normal = True
            continue
        if text == SPECIAL_NO_INDEXING:
            result.no_indexing = True
            continue
        if not text:
            continue
        result.n_terms += 1
        term, head, quals = parse_code(code)
        if term is None:
            result.unmapped_terms.append(head)
            term = Term(snake(head), "unclassified_finding")
        else:
            result.mapped_terms += 1
        finding = term.finding
        if finding not in result.findings:
            result.findings.append(finding)
        laterality = next((q for q in quals if q in LATERALITY), None)
        locations = [q for q in quals if q in LOCATION]
        head_is_anatomy = head in ANATOMY_TERMS
        # The qualifier that selected a variant names the finding, not an attribute of it.
        variants = FINDING_VARIANTS.get(head, {})
        # On an anatomy head, laterality alone sits on that organ (right_hemidiaphragm).
        organ = ANATOMY_TERMS[head][0] if head_is_anatomy else term.site
        location = _anatomy(laterality, locations, organ)
        if location is None and head_is_anatomy and organ not in ("lung", "cardiac_silhouette") \
                and not set(organ.split("_")) & set(finding.split("_")):
            location = organ  # degenerative_change HAS_LOCATION thoracic_spine
        if location:
            add((finding, "HAS_LOCATION", location))
        for q in quals:
            kind = qualifier_kind(q)
            if kind == "severity":
                add((finding, "HAS_SEVERITY", q))
            elif kind == "attribute" and q not in variants:
                add((finding, "HAS_ATTRIBUTE", q))
            elif kind == "state" and not head_is_anatomy:
                add((finding, "HAS_ATTRIBUTE", q))
            elif kind == "unknown":
                result.unmapped_qualifiers.append(q)
                add((finding, "HAS_ATTRIBUTE", snake(q)))
        add((finding, "IS_A", term.category))
        for label, value in term.labels:
            # 1 (positive) beats -1 (only suggested by some code).
            label_values[label] = max(label_values.get(label, value), value)
    if result.findings:
        labels: dict[str, int | None] = dict(label_values)
        pathological = any(labels.get(name) in (1, -1) for name in _PATHOLOGY_LABELS)
        labels["No Finding"] = 0 if pathological else 1
        result.labels = labels
    elif result.normal:
        result.labels = {"No Finding": 1}
    return result


def coverage(rows: Iterable[list[str]]) -> dict:
    """Mapping coverage over many studies' code lists (what the module docstring promises)."""
    terms = mapped = 0
    unmapped_terms: Counter = Counter()
    unmapped_quals: Counter = Counter()
    quals_total = 0
    for codes in rows:
        res = mesh_to_annotations(codes)
        terms += res.n_terms
        mapped += res.mapped_terms
        unmapped_terms.update(res.unmapped_terms)
        unmapped_quals.update(res.unmapped_qualifiers)
        quals_total += sum(len([q for q in c.split("/")[1:] if q.strip()]) for c in codes
                           if _norm(c) not in (SPECIAL_NORMAL, SPECIAL_NO_INDEXING))
    return {"terms": terms, "mapped_terms": mapped,
            "term_coverage": round(mapped / terms, 4) if terms else 1.0,
            "qualifiers": quals_total,
            "qualifier_coverage": round(1 - sum(unmapped_quals.values()) / quals_total, 4) if quals_total else 1.0,
            "unmapped_terms": dict(unmapped_terms.most_common()),
            "unmapped_qualifiers": dict(unmapped_quals.most_common())}


if __name__ == "__main__":  # coverage report for a JSONL file with a "mesh" list per row
    with open(sys.argv[1], encoding="utf-8") as fh:
        print(json.dumps(coverage(json.loads(line).get("mesh", []) for line in fh if line.strip()), indent=1))
